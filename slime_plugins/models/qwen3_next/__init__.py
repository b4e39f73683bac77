"""Qwen3-Next (qwen3_next) on Megatron-core: Gated DeltaNet linear attention in three of every four layers,
gated attention in the others, softmax-routed experts with a gated shared expert, zero-centred RMSNorms."""

from slime_plugins.models.registry import ModelFamily

_MODEL = "slime_plugins.models.qwen3_next.model"

FAMILY = ModelFamily(
    name="qwen3_next",
    model_types=("qwen3_next",),
    parse_config="slime_plugins.models.qwen3_next.config:from_hf",
    build_model=f"{_MODEL}:build_model",
    weight_maps=f"{_MODEL}:maps_for_model",
    hf_names=f"{_MODEL}:hf_names",
    tiny_config="slime_plugins.models.qwen3_next.tiny:tiny_config",
    transformers_class="Qwen3NextForCausalLM",
    description="hybrid decoder: Gated DeltaNet + output-gated GQA, MoE with gated shared expert",
)
