"""Upstream slime's `slime.utils.processing_utils`, the helpers its vision-language examples import: tokenizer and
processor loading, the keyword arguments a processor call takes, images pulled out of chat messages, and an
image encoded as the data URI an engine's request carries.

This project trains text models; these helpers prepare data only. Pillow is imported where an image is handled
(it is a dependency of transformers' image processors, not of this project)."""

from __future__ import annotations

import base64
import io
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Vision patch size when a processor does not state one (upstream's; Qwen2.5-VL's 14, Qwen3-VL states its 16).
DEFAULT_PATCH_SIZE = 14


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """Keyword arguments for a processor call: the given ones, text as plain lists (no tensors, no modality token
    types) and every modality's outputs as torch tensors."""
    out = dict(multimodal_inputs) if multimodal_inputs else {}
    out["text_kwargs"] = {**out.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        out[key] = {**out.get(key, {}), "return_tensors": "pt"}
    return out


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The checkpoint's multimodal processor, or None where it has none (a text checkpoint, for which
    transformers returns a tokenizer, or a directory it cannot read). Upstream's second try, a Glm4vProcessor
    built by hand for GLM-4.5V / 4.6V, is for transformers < 5, whose AutoProcessor lacks them; this project
    requires transformers 5, where AutoProcessor loads them."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as e:
        logger.warning("no processor loaded from %s: %s", name_or_path, e)
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def _open_image(data: str) -> Any:
    from PIL import Image

    if data.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1])))
    try:
        return Image.open(io.BytesIO(base64.b64decode(data)))
    except Exception:  # not base64 of an image: a file path (upstream's order)
        return Image.open(data)


def _images_in_messages(messages: list[dict]) -> list:
    """PIL images of the {"type": "image", "image": ...} content items: PIL images, data URIs, base64, paths."""
    from PIL import Image

    images = []
    for message in messages:
        content = message.get("content", [])
        if not isinstance(content, list):
            continue
        for item in content:
            if not isinstance(item, dict) or item.get("type") != "image" or item.get("image") is None:
                continue
            image = item["image"]
            if isinstance(image, Image.Image):
                images.append(image)
            elif isinstance(image, str):
                images.append(_open_image(image))
    return images


def process_vision_info(prompt: list[dict], processor: Any) -> dict:
    """{"images": [...] or None, "videos": ... or None} of a chat prompt: qwen_vl_utils' extraction when it is
    installed (with the processor's patch size), else the images of the messages' image items."""
    try:
        from qwen_vl_utils import process_vision_info as qwen_process_vision_info

        patch_size = getattr(processor.image_processor, "patch_size", DEFAULT_PATCH_SIZE)
        images, videos = qwen_process_vision_info(prompt, image_patch_size=patch_size)
    except Exception:  # qwen_vl_utils missing or refusing the prompt: upstream falls back the same way
        images, videos = _images_in_messages(prompt) or None, None
    return {"images": images, "videos": videos}


def encode_image_for_rollout_engine(image: Any) -> str:
    """A PIL image as an RGB PNG data URI."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("utf-8")
