"""The transformers model class that runs a checkpoint's model_type where transformers' auto classes do not give
one (the embedded engine, the tiny-checkpoint writer, the tests' references).

- `CAUSAL_LM_CLASSES`: text-only model_types whose causal-LM class transformers lacks, served by a class of this
  project built from transformers' own text model (glm5_next_text: transformers 5.24 has only the multimodal
  Glm5NextForConditionalGeneration).
- A model_type that transformers maps only in its image-text-to-text auto class (glm5_next): that class, the
  vision tower included.
"""

from __future__ import annotations

import importlib
from typing import Any

CAUSAL_LM_CLASSES: dict[str, str] = {
    "glm5_next_text": "slime_plugins.models.glm5_next.causal_lm:Glm5NextTextForCausalLM",
}


def causal_lm_class(model_type: str) -> Any:
    """The class of CAUSAL_LM_CLASSES or of transformers' image-text-to-text auto mapping for `model_type`, where
    AutoModelForCausalLM has none; None when AutoModelForCausalLM serves it (or nothing does)."""
    from transformers.models.auto import modeling_auto

    if model_type in CAUSAL_LM_CLASSES:
        module, _, name = CAUSAL_LM_CLASSES[model_type].partition(":")
        return getattr(importlib.import_module(module), name)
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    name = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if name is None:
        return None
    import transformers

    return getattr(transformers, name, None)


def checkpoint_class(model_path: str) -> Any:
    """`causal_lm_class` of the model_type in `model_path`/config.json (None if unreadable)."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
    return causal_lm_class(model_type) if isinstance(model_type, str) else None
