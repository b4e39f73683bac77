"""MiniMax-M2 config.json -> GqaConfig. What transformers' MiniMaxM2 reads: every layer MoE (num_local_experts
routed experts of intermediate_size, top num_experts_per_tok), router sigmoid(logits) + e_score_correction_bias
for the choice, the chosen unbiased scores renormalised (no scaling, no groups, no shared expert); q_norm / k_norm
over the whole q / k projection (published `qk_norm_type: per_layer`); rotary on `rotary_dim` of head_dim features
(published configs give rotary_dim, transformers 5 partial_rotary_factor). The full-width norms are the family's
attention (minimax_m2/model.py), so the shared per-head QK-norm stays off."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.config import UnsupportedModelError
from slime_plugins.models.common.gqa_config import GqaConfig, build
from slime_plugins.models.common.tiny import TINY_GQA, transformers_config


def _with_partial_rotary(hf: dict[str, Any]) -> dict[str, Any]:
    """Published configs state rotary_dim (64 of 128); transformers derives partial_rotary_factor from it."""
    params = hf.get("rope_parameters") or {}
    if hf.get("rotary_dim") is None or "partial_rotary_factor" in params or "partial_rotary_factor" in hf:
        return hf
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return hf | {"partial_rotary_factor": int(hf["rotary_dim"]) / head_dim}


def from_hf(hf: dict[str, Any]) -> GqaConfig:
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or not hf.get("use_routing_bias", True):
        raise UnsupportedModelError("minimax_m2: only the sigmoid router with routing bias (transformers' MiniMaxM2) "
                                    "is supported")
    if hf.get("qk_norm_type", "per_layer") != "per_layer" or not hf.get("use_qk_norm", True):
        raise UnsupportedModelError(f"minimax_m2: qk_norm_type={hf.get('qk_norm_type')!r} / use_qk_norm="
                                    f"{hf.get('use_qk_norm')!r}: only the full-width QK norm (per_layer) is supported")
    if int(hf.get("shared_intermediate_size") or 0):
        raise UnsupportedModelError("minimax_m2: shared experts (shared_intermediate_size > 0) are not in "
                                    "transformers' MiniMaxM2; not supported")
    hf = _with_partial_rotary(hf)
    experts = int(hf.get("num_local_experts", hf.get("num_experts", 0)))
    return build(hf, mlp_layer_types=("sparse",) * int(hf["num_hidden_layers"]), n_routed_experts=experts,
                 moe_intermediate_size=int(hf["intermediate_size"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                 router="sigmoid", router_dtype_float32=False, norm_topk_prob=True, full_width_qk_norm=True)


def tiny_config(model_type: str = "minimax_m2", **overrides: Any):
    """MiniMax-M2's shape in miniature: 8 experts top-2 in every layer, rotary on 8 of 16 head features."""
    base = TINY_GQA | dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8,
                           tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                                       "partial_rotary_factor": 0.5})
    return transformers_config(model_type, base, overrides)
