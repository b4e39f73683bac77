"""Tiny GLM-5.3-Flash configs (tests): 5 layers, hidden 64, 4 streams.

    layer       0       1       2            3              4
    mixer       KDA     KDA     DSA "full"   DSA "shared"   KDA
    MLP         dense   MoE     MoE          MoE            MoE

A default two-stage pipeline split (2 | 3 layers) keeps the shared DSA layer on the stage of the full layer
whose top-k it reuses. index_topk 8 over k-pools of 4 tokens, so sequences longer than 8 make DSA drop keys;
swiglu_limit 0.15 is small enough that random-init activations are clamped (the published value, 10, would
never clamp at this scale). `glm5_next` is the multimodal checkpoint with a one-block vision tower.
"""

from __future__ import annotations

from typing import Any

TINY_TEXT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "full", "shared", "full"],
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=8, index_kpool=4, index_kpool_always_select_tail=True,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=0.15,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5, max_position_embeddings=512,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# the vision tower, as small as transformers builds it (kept unchanged by the trainer); out_hidden_size = text hidden
TINY_VISION: dict[str, Any] = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                                   projection_intermediate_size=32, patch_size=4, temporal_patch_size=2,
                                   spatial_merge_size=2, in_channels=3, image_size=16, swiglu_limit=0.15)


def tiny_config(model_type: str = "glm5_next", **overrides: Any):
    """The transformers config of the tiny model: `Glm5NextConfig` (multimodal; overrides apply to its text
    config) or `Glm5NextTextConfig` (flat text-only checkpoints)."""
    from transformers import AutoConfig

    if model_type == "glm5_next_text":
        return AutoConfig.for_model(model_type, **(TINY_TEXT | overrides))
    if model_type != "glm5_next":
        raise ValueError(f"no tiny config for model_type {model_type!r}; choose glm5_next or glm5_next_text")
    text = tiny_config("glm5_next_text", **overrides).to_dict()
    return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=False)
