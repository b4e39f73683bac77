"""Qwen3-MoE (GQA with QK-norm, softmax-routed experts, no shared expert) on Megatron-core."""

from slime_plugins.models.common import gqa_family

FAMILY = gqa_family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM",
                    "GQA decoder with QK-norm; softmax top-k routed experts (no shared expert)")
