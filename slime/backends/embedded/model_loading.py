"""The engine's transformers model from an HF checkpoint directory: the class that runs its model_type (also
one transformers does not ship, through the model family that names its class), and block-FP8 checkpoints
(fp8_checkpoint.py) built from their config with every tensor loaded by checkpoint name, the FP8 ones
dequantized."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from slime.backends.embedded.errors import BadRequest
from slime.backends.embedded.fp8_checkpoint import Fp8Layout, layout_of_dir
from slime.backends.embedded.weights import WeightNameMap, apply_plan, plan_disk_update


@dataclass(frozen=True)
class _ModelFor:
    model_class: Any
    config: Any


def _config_for_unknown_type(model_path: str) -> _ModelFor | None:
    """A checkpoint whose model_type transformers does not ship (Kimi-K2's kimi_k2, a DeepseekV3ForCausalLM):
    the transformers class its model family names, with that class's config read from config.json. None when
    transformers knows the type (AutoModelForCausalLM loads it) or no family serves it."""
    import transformers
    from transformers import CONFIG_MAPPING

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError:
        return None
    model_type = cfg.get("model_type")
    if not model_type or model_type in CONFIG_MAPPING:
        return None
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    try:
        family = get_family(model_type)
    except UnsupportedModelError:
        return None
    model_class = getattr(transformers, family.transformers_class, None)
    if model_class is None:
        return None
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config", "auto_map")}
    return _ModelFor(model_class, model_class.config_class(**fields))


def load_pretrained(model_path: str, **kwargs: Any) -> torch.nn.Module:
    """The checkpoint's model (kwargs: from_pretrained's dtype, attn_implementation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_plugins.models.common.hf_classes import checkpoint_class

    known = _config_for_unknown_type(model_path)
    # GLM-5.3-Flash: a model_type AutoModelForCausalLM does not load (common/hf_classes.py)
    model_class = known.model_class if known else checkpoint_class(model_path) or AutoModelForCausalLM
    fp8 = layout_of_dir(model_path)
    if fp8 is not None:
        config = known.config if known else AutoConfig.from_pretrained(model_path)
        return load_fp8(model_class, config, model_path, fp8, **kwargs)
    if known is not None:
        return model_class.from_pretrained(model_path, config=known.config, **kwargs)
    return model_class.from_pretrained(model_path, **kwargs)


def load_fp8(model_class: Any, config: Any, model_path: str, layout: Fp8Layout, **kwargs: Any) -> torch.nn.Module:
    """`model_class` built from `config` (its quantization_config dropped: the engine computes in high
    precision) with every checkpoint tensor of `model_path` loaded, the block-FP8 ones dequantized. transformers'
    own host dequantization is not used: it refuses weights whose rows or columns are not a multiple of the block.
    BadRequest, one line, for a malformed checkpoint."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    config._name_or_path = model_path  # a multimodal checkpoint's names (WeightNameMap's prefix changes)
    if kwargs.get("dtype") == "auto":  # a device engine keeps the checkpoint's high-precision dtype
        kwargs["dtype"] = _high_precision_dtype(config)
    # an auto class builds through from_config, a model class through _from_config (the same, minus the lookup)
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    model = build(config, **kwargs)
    try:
        plan = plan_disk_update(WeightNameMap(model), model_path, layout)
    except BadRequest as e:
        rejected = "weight update rejected, nothing changed: "
        problem = str(e).removeprefix(f"{rejected}{model_path}: ").removeprefix(rejected)
        raise BadRequest(f"cannot serve {model_path}: {problem}") from None
    apply_plan(plan)
    return model


def _high_precision_dtype(config: Any) -> torch.dtype:
    """The dtype config.json names for the unquantized tensors (GLM-5.3-Flash: bfloat16), else float32."""
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "dtype", None) if cfg is not None else None
        value = getattr(torch, value, None) if isinstance(value, str) else value
        if isinstance(value, torch.dtype) and value.is_floating_point and value.itemsize >= 2:
            return value
    return torch.float32
