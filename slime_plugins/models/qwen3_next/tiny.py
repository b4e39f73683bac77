"""Tiny configs of the hybrid Qwen types: 4 layers alternating Gated DeltaNet and gated attention
(full_attention_interval 2), 2 key / 4 value DeltaNet heads, 4 experts top-2 with a gated shared expert;
qwen3_next keeps layer 0 dense (mlp_only_layers) so both MLP kinds run."""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.tiny import TINY_GQA, transformers_config

TINY_HYBRID: dict[str, Any] = TINY_GQA | dict(
    num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25})
TINY_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48)


# the vision-language types' vision tower, as small as transformers builds it (kept unchanged by the trainer)
TINY_VISION: dict[str, Any] = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)


def tiny_config(model_type: str = "qwen3_next", **overrides: Any):
    """qwen3_5 / qwen3_5_moe: the vision-language wrapper around the text type's tiny config."""
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        text = tiny_config(model_type + "_text", **overrides).to_dict()
        return transformers_config(model_type, dict(text_config=text, vision_config=TINY_VISION,
                                                    tie_word_embeddings=False), {})
    base = dict(TINY_HYBRID)
    if model_type == "qwen3_next":
        base |= TINY_MOE | dict(decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True)
    elif model_type == "qwen3_5_moe_text":
        base |= TINY_MOE
    elif model_type != "qwen3_5_text":
        raise ValueError(f"no tiny config for model_type {model_type!r}")
    return transformers_config(model_type, base, overrides)
