"""Qwen3 dense (GQA with per-head QK RMSNorm) on Megatron-core."""

from slime_plugins.models.common import gqa_family

FAMILY = gqa_family("qwen3", "qwen3", "Qwen3ForCausalLM", "dense GQA decoder with QK-norm")
