"""Qwen3 config.json -> GqaConfig: per-head QK RMSNorm; attention_bias biases q, k, v and o."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, build, dense_layers
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    bias = bool(hf.get("attention_bias", False))
    return build(hf, mlp_layer_types=dense_layers(hf), qkv_bias=bias, o_bias=bias, qk_norm=True)


def tiny_config(model_type: str = "qwen3", **overrides: Any):
    """Tied embeddings, as Qwen3-4B."""
    return transformers_config(model_type, TINY_GQA | dict(tie_word_embeddings=True), overrides)
