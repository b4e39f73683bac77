"""GLM-4.5 / 4.6 / 4.7-355B (GQA, partial rotary, optional QK-norm, sigmoid-routed MoE with a shared
expert) on Megatron-core."""

from slime_plugins.models.common import gqa_family

FAMILY = gqa_family("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM",
                    "GQA decoder with partial rotary and optional QK-norm; sigmoid-routed MoE + shared expert")
