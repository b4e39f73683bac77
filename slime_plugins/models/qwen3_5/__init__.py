"""Qwen3.5 dense and MoE (qwen3_5, qwen3_5_moe: the vision-language checkpoints, whose text model is trained
and whose vision tower is kept unchanged; qwen3_5_text, qwen3_5_moe_text: text-only) on Megatron-core: the
qwen3_next architecture with separate DeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

from slime_plugins.models.registry import ModelFamily

_MODEL = "slime_plugins.models.qwen3_next.model"

FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text"),
    parse_config="slime_plugins.models.qwen3_next.config:from_hf",
    build_model=f"{_MODEL}:build_model",
    weight_maps=f"{_MODEL}:maps_for_model",
    hf_names=f"{_MODEL}:hf_names",
    tiny_config="slime_plugins.models.qwen3_next.tiny:tiny_config",
    transformers_class="Qwen3_5ForCausalLM",
    description="Qwen3-Next's hybrid decoder with Qwen3.5's DeltaNet projections; dense or MoE",
)
