"""Llama (dense GQA, optional attention bias, tied embeddings allowed) on Megatron-core."""

from slime_plugins.models.common import gqa_family

FAMILY = gqa_family("llama", "llama", "LlamaForCausalLM", "dense GQA decoder; attention_bias on q/k/v/o")
