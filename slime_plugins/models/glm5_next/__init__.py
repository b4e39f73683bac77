"""GLM-5.3-Flash (glm5_next: the multimodal checkpoint, whose text model is trained and whose vision tower is
kept unchanged; glm5_next_text: flat text-only checkpoints) on Megatron-core: KDA linear attention and DSA
(NoPE MLA with a k-pool lightning indexer) layers, mHC hyper-connections (hc_mult residual streams),
sigmoid-routed MoE with a shared expert, SwiGLU clamped at swiglu_limit."""

from slime_plugins.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="glm5_next",
    model_types=("glm5_next", "glm5_next_text"),
    parse_config="slime_plugins.models.glm5_next.config:from_hf",
    build_model="slime_plugins.models.glm5_next.model:build_model",
    weight_maps="slime_plugins.models.glm5_next.weights:maps_for_model",
    hf_names="slime_plugins.models.glm5_next.weights:hf_names",
    mtp_names="slime_plugins.models.glm5_next.mtp:mtp_names",
    tiny_config="slime_plugins.models.glm5_next.tiny:tiny_config",
    transformers_class="Glm5NextForConditionalGeneration",
    description="KDA + DSA (NoPE MLA, k-pool indexer) hybrid with mHC streams, clamped-SwiGLU MoE; vision tower kept",
)
