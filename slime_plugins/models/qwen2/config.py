"""Qwen2 config.json -> GqaConfig: q/k/v always biased (transformers' Qwen2Attention), o unbiased."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, build, dense_layers
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    return build(hf, mlp_layer_types=dense_layers(hf), qkv_bias=True, o_bias=False)


def tiny_config(model_type: str = "qwen2", **overrides: Any):
    return transformers_config(model_type, TINY_GQA | dict(tie_word_embeddings=True), overrides)
