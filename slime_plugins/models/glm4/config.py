"""GLM-4 (glm4) config.json -> GqaConfig: attention_bias biases q, k, v (transformers' default true; o unbiased);
rotary on head_dim x partial_rotary_factor features (default 0.5) in GPT-J interleaved pairs; every layer
dense. The post-attention / post-MLP norms are the family's modules (glm4/model.py)."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, build, dense_layers
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    hf = dict(hf)
    rope = hf.get("rope_parameters")
    if rope is not None and "partial_rotary_factor" not in rope:  # transformers' Glm4Config default
        hf["rope_parameters"] = dict(rope) | {"partial_rotary_factor": hf.get("partial_rotary_factor", 0.5)}
    elif rope is None:
        hf.setdefault("partial_rotary_factor", 0.5)
    return build(hf, mlp_layer_types=dense_layers(hf), qkv_bias=bool(hf.get("attention_bias", True)), o_bias=False,
                 rope_interleaved=True)


def tiny_config(model_type: str = "glm4", **overrides: Any):
    """GLM-4-9B's shape in miniature: 4 query heads over 2 key/value heads, qkv bias, partial rotary 0.5."""
    base = TINY_GQA | dict(attention_bias=True, tie_word_embeddings=False,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    return transformers_config(model_type, base, overrides)
