"""DeepSeek-V3 family (deepseek_v3: DeepSeek-V3 / R1, Moonlight; kimi_k2: Kimi-K2) on Megatron-core, built from
the GLM-5 family's MLA, MoE and MTP blocks (glm5/) without the DSA indexer."""

from slime_plugins.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    parse_config="slime_plugins.models.deepseek_v3.config:DeepseekV3Config.from_hf",
    build_model="slime_plugins.models.glm5.model:build_model",
    weight_maps="slime_plugins.models.glm5.weights:maps_for_model",
    hf_names="slime_plugins.models.glm5.weights:hf_names",
    mtp_names="slime_plugins.models.glm5.model:mtp_names",
    tiny_config="slime_plugins.models.deepseek_v3.tiny:tiny_config",
    transformers_class="DeepseekV3ForCausalLM",
    description="multi-latent attention with YaRN mscale, sigmoid group-limited routing (expert bias) + shared experts",
)
