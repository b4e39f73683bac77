"""DeepSeek-V3-family architecture (DeepSeek-V3 / R1, Kimi-K2, Moonlight) from an HF config.json.

The architecture is GLM-4.7-Flash's (glm5/ without DSA): MLA (optional q LoRA), YaRN rotary with mscale
(softmax scale x mscale(factor, mscale_all_dim)^2, cos/sin x mscale / mscale_all_dim), first_k_dense_replace
dense layers, then sigmoid routing over expert groups with the expert bias (noaux_tc) and shared experts.
Kimi-K2 ships `model_type: kimi_k2` with `architectures: [DeepseekV3ForCausalLM]`; transformers has no
kimi_k2 type, so its config class is deepseek_v3's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from slime_plugins.models.common.config import UnsupportedModelError
from slime_plugins.models.glm5.config import GlmConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
__all__ = ["DeepseekV3Config", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError"]


@dataclass(frozen=True)
class DeepseekV3Config(GlmConfig):
    served_model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    reader_name: ClassVar[str] = "DeepSeek-V3"
    default_first_k_dense: ClassVar[int] = 3  # transformers' DeepseekV3Config default

    @property
    def transformers_model_type(self) -> str:
        return "deepseek_v3"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DeepseekV3Config":
        # DeepSeek's own code also reads moe_layer_freq (MoE every N-th layer); transformers ignores it and
        # every published checkpoint has 1.
        if int(hf.get("moe_layer_freq", 1) or 1) != 1:
            raise UnsupportedModelError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (published "
                                        "DeepSeek-V3-family checkpoints use 1: every layer after first_k_dense_replace is MoE)")
        if "mlp_layer_types" in hf:
            raise UnsupportedModelError("mlp_layer_types is not a DeepSeek-V3 config key; use first_k_dense_replace")
        return super().from_hf(hf)
