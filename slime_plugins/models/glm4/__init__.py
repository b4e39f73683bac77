"""GLM-4 dense family (glm4: GLM-4-9B-0414, GLM-Z1-9B/32B, GLM-4-32B-0414) on Megatron-core: the shared GQA
attention with qkv bias and interleaved partial rotary, plus RMSNorms on the attention and MLP outputs."""

from slime_plugins.models.registry import ModelFamily

_MODEL = "slime_plugins.models.glm4.model"

FAMILY = ModelFamily(
    name="glm4",
    model_types=("glm4",),
    parse_config="slime_plugins.models.glm4.config:from_hf",
    build_model=f"{_MODEL}:build_model",
    weight_maps=f"{_MODEL}:maps_for_model",
    hf_names=f"{_MODEL}:hf_names",
    tiny_config="slime_plugins.models.glm4.config:tiny_config",
    transformers_class="Glm4ForCausalLM",
    description="GQA decoder (qkv bias, interleaved partial rotary) with post-attention and post-MLP RMSNorms",
)
