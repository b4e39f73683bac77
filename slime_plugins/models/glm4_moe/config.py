"""GLM-4.5-family (glm4_moe) config.json -> GqaConfig: attention_bias biases q, k, v (o unbiased);
use_qk_norm; rotary on head_dim x partial_rotary_factor features; the first first_k_dense_replace layers
dense, then MoE with the GLM sigmoid router (expert bias, groups, routed_scaling_factor; float32) and
n_shared_experts shared experts. MTP layers (num_nextn_predict_layers) are kept unchanged, not trained."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, build
from slime_plugins.models.common.config import UnsupportedModelError
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError("glm4_moe: only the sigmoid + expert-bias (noaux_tc) router is supported")
    n, k_dense = int(hf["num_hidden_layers"]), int(hf.get("first_k_dense_replace", 1))
    types = ("dense",) * min(k_dense, n) + ("sparse",) * max(n - k_dense, 0)
    return build(hf, mlp_layer_types=types, qkv_bias=bool(hf.get("attention_bias", False)), o_bias=False,
                 qk_norm=bool(hf.get("use_qk_norm", False)),
                 n_routed_experts=int(hf.get("n_routed_experts", hf.get("num_local_experts", 0))),
                 n_shared_experts=int(hf.get("n_shared_experts") or 0),
                 moe_intermediate_size=int(hf["moe_intermediate_size"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                 router="sigmoid", router_dtype_float32=True, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                 n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                 routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                 mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0))


def tiny_config(model_type: str = "glm4_moe", **overrides: Any):
    """GLM-4.5's shape in miniature: qkv bias, QK-norm, partial rotary 0.5, 1 dense + 2 MoE layers,
    8 routed experts in 2 groups (top-2 of 1 group) + 1 shared, routed_scaling_factor 2.5."""
    base = TINY_GQA | dict(num_hidden_layers=3, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                           num_nextn_predict_layers=0, tie_word_embeddings=False,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    return transformers_config(model_type, base, overrides)
