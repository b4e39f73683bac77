"""MiniMax-M2 / M2.5 (minimax_m2) on Megatron-core: GQA with RMSNorm over all query heads and over all key
heads together (not per head), partial rotary, every layer a sigmoid-routed MoE with expert bias and no shared
expert (transformers' MiniMaxM2ForCausalLM)."""

from slime_plugins.models.registry import ModelFamily

_MODEL = "slime_plugins.models.minimax_m2.model"

FAMILY = ModelFamily(
    name="minimax_m2",
    model_types=("minimax_m2",),
    parse_config="slime_plugins.models.minimax_m2.config:from_hf",
    build_model=f"{_MODEL}:build_model",
    weight_maps=f"{_MODEL}:maps_for_model",
    hf_names=f"{_MODEL}:hf_names",
    tiny_config="slime_plugins.models.minimax_m2.config:tiny_config",
    transformers_class="MiniMaxM2ForCausalLM",
    description="GQA with full-width QK RMSNorm and partial rotary; sigmoid-routed MoE (expert bias) in every layer",
)
