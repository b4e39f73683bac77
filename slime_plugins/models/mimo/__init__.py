"""MiMo-7B (mimo: Xiaomi's Qwen2 layout plus MTP layers `model.mtp_layers.{k}`) on Megatron-core: the qwen2
family's model with the GLM-5 family's MTP block in MiMo's wiring. transformers ships no `mimo` type: the
embedded engine serves the main model as Qwen2ForCausalLM (MTP layers are the speculative draft, SGLang's)."""

from slime_plugins.models.registry import ModelFamily

_MODEL = "slime_plugins.models.mimo.model"

FAMILY = ModelFamily(
    name="mimo",
    model_types=("mimo",),
    parse_config="slime_plugins.models.mimo.config:from_hf",
    build_model=f"{_MODEL}:build_model",
    weight_maps=f"{_MODEL}:maps_for_model",
    hf_names="slime_plugins.models.common.gqa_model:hf_names",
    mtp_names=f"{_MODEL}:mtp_names",
    transformers_class="Qwen2ForCausalLM",
    description="Qwen2 decoder (GQA, q/k/v bias) with MTP layers: token/hidden norms, input_proj, a Qwen2 layer, final norm",
)
