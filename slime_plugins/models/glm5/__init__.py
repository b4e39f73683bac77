"""GLM-5 family (glm_moe_dsa: MLA + DSA indexer + MoE; glm4_moe_lite, GLM-4.7-Flash: MLA + MoE) on Megatron-core."""

from slime_plugins.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="glm5",
    model_types=("glm_moe_dsa", "glm4_moe_lite"),
    parse_config="slime_plugins.models.glm5.config:GlmConfig.from_hf",
    build_model="slime_plugins.models.glm5.model:build_model",
    weight_maps="slime_plugins.models.glm5.weights:maps_for_model",
    hf_names="slime_plugins.models.glm5.weights:hf_names",
    mtp_names="slime_plugins.models.glm5.model:mtp_names",
    tiny_config="slime_plugins.models.glm5.tiny:tiny_config",
    transformers_class="GlmMoeDsaForCausalLM / Glm4MoeLiteForCausalLM",
    description="multi-latent attention (DSA sparse attention for glm_moe_dsa), sigmoid-routed MoE + shared expert",
)
