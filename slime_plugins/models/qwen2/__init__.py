"""Qwen2 / Qwen2.5 (dense GQA with q/k/v bias) on Megatron-core."""

from slime_plugins.models.common import gqa_family

FAMILY = gqa_family("qwen2", "qwen2", "Qwen2ForCausalLM", "dense GQA decoder; q/k/v bias always, o unbiased")
