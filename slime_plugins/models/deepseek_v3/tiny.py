"""Tiny DeepSeek-V3-family configs (tests): `python -m slime_plugins.models.common.tiny OUT --model-type deepseek_v3`.

DeepSeek-V3 shape at toy size: q LoRA, YaRN (factor 4, mscale != mscale_all_dim so both the cos/sin factor
and the softmax scale differ from 1), 8 experts in 4 groups of which 2 are kept, 1 dense layer first.
Moonlight (no q LoRA, 2 shared experts, plain rotary, one group) is the override `MOONLIGHT`."""

from __future__ import annotations

from typing import Any

TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    num_nextn_predict_layers=0,
    rope_interleave=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
)

# Moonlight-16B-A3B's differences: plain q projection, 2 shared experts, no rope scaling, one expert group.
MOONLIGHT: dict[str, Any] = dict(q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1, num_experts_per_tok=3,
                                 routed_scaling_factor=2.446, rms_norm_eps=1e-5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def tiny_config(model_type: str = "deepseek_v3", **overrides: Any):
    """A transformers DeepseekV3Config of the tiny model (kimi_k2 has no transformers type of its own)."""
    from slime_plugins.models.common.tiny import transformers_config

    if model_type != "deepseek_v3":
        raise ValueError(f"no tiny config for model_type {model_type!r}; the DeepSeek-V3 family's is 'deepseek_v3' "
                         "(a kimi_k2 checkpoint is a deepseek_v3 one with model_type renamed)")
    return transformers_config("deepseek_v3", TINY_DEEPSEEK_V3, overrides)
