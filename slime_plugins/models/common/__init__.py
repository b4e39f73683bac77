"""Building blocks every model family shares (decoder model, GQA attention, MLP / MoE layers, rotary
tables, HF weight maps, tiny checkpoints). Importing this package imports neither torch nor megatron."""

from slime_plugins.models.registry import ModelFamily

_GQA = "slime_plugins.models.common.gqa_model"


def gqa_family(name: str, model_type: str, transformers_class: str, description: str) -> ModelFamily:
    """The registry entry of a grouped-query-attention family whose folder `slime_plugins/models/<name>/`
    holds `config.py` with `from_hf(config_dict)` and `tiny_config(model_type, **overrides)`; model,
    weight maps and HF names are the shared GQA ones (common/gqa_model.py)."""
    config = f"slime_plugins.models.{name}.config"
    return ModelFamily(name=name, model_types=(model_type,), parse_config=f"{config}:from_hf",
                       build_model=f"{_GQA}:build_model", weight_maps=f"{_GQA}:maps_for_model",
                       hf_names=f"{_GQA}:hf_names", tiny_config=f"{config}:tiny_config",
                       transformers_class=transformers_class, description=description)
