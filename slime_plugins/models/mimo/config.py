"""MiMo config.json -> MimoConfig: Qwen2's architecture (qwen2/config.py) plus num_nextn_predict_layers MTP layers,
each a dense Qwen2 decoder layer (published modeling_mimo.py: MiMoMTPLayers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig
from slime_plugins.models.qwen2.config import from_hf as qwen2_from_hf


@dataclass(frozen=True)
class MimoConfig(GqaConfig):
    @property
    def transformers_model_type(self) -> str:
        return "qwen2"  # the config class transformers reads a MiMo config.json with (rope tables)

    @property
    def kept_hf_prefixes(self) -> tuple[str, ...]:
        return ("model.mtp_layers.",)  # MTP tensors (common/weights.is_mtp_name): trained with MTP, else kept

    def mlp_type(self, layer: int) -> str:
        return "dense"  # MTP layers too (DeepSeek-V3's are MoE)


def from_hf(hf: dict[str, Any]) -> MimoConfig:
    base = qwen2_from_hf(hf | {"model_type": "qwen2"})
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return MimoConfig(**fields | {"model_type": hf["model_type"], "hf_config": dict(hf),
                                  "mtp_num_layers": int(hf.get("num_nextn_predict_layers") or 0)})
