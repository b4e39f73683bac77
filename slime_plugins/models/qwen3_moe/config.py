"""Qwen3-MoE config.json -> GqaConfig. Layer i is MoE unless listed in mlp_only_layers, when
(i + 1) % decoder_sparse_step == 0 (transformers' Qwen3MoeDecoderLayer rule). Router: softmax over
the experts in float32 from model-dtype logits, top-k, renormalised when norm_topk_prob."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, build
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def _num_experts(hf: dict[str, Any]) -> int:
    value = hf.get("num_experts", hf.get("num_local_experts"))  # hub configs: num_experts; transformers 5: either
    return int(value or 0)


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    n, experts = int(hf["num_hidden_layers"]), _num_experts(hf)
    step, dense_only = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    types = tuple("sparse" if experts > 0 and i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n))
    bias = bool(hf.get("attention_bias", False))
    return build(hf, mlp_layer_types=types, qkv_bias=bias, o_bias=bias, qk_norm=True, n_routed_experts=experts,
                 moe_intermediate_size=int(hf["moe_intermediate_size"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                 router="softmax", router_dtype_float32=False, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def tiny_config(model_type: str = "qwen3_moe", **overrides: Any):
    """8 experts, top-2; layer 0 dense (mlp_only_layers) so both layer kinds run."""
    base = TINY_GQA | dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False)
    return transformers_config(model_type, base, overrides)
