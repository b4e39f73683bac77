"""The experts each MoE router of the engine's model chose, per token, as SGLang returns them with
`return_routed_experts` (`meta_info["routed_experts"]`): base64 of int32 [rows, num_hidden_layers, top_k],
one row per token of prompt + response except the last (never fed to the model), dense layers' columns 0.

The transformers MoE families the engine serves (GLM-5 `glm_moe_dsa`, `glm4_moe`, `deepseek_v3`, `qwen3_moe`)
route in `layer.mlp.gate(hidden) -> (logits, weights, expert ids)`; a forward hook on each gate keeps the ids
of the current forward while capturing is on.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch


class RouteCapture:
    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.enabled = False
        self._ids: dict[int, torch.Tensor] = {}
        self.moe_layers: list[int] = []
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        for i, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is None or not hasattr(gate, "top_k"):  # dense MLPs have gate_proj, not a router
                continue
            gate.register_forward_hook(self._hook(i))
            self.moe_layers.append(i)

    @property
    def available(self) -> bool:
        return bool(self.moe_layers) and self.top_k > 0

    def _hook(self, layer: int):
        def keep(module: Any, inputs: Any, output: Any) -> None:
            if self.enabled:
                self._ids[layer] = output[2].detach()
        return keep

    def take(self, batch: int, width: int) -> torch.Tensor:
        """The last forward's choices as int32 [batch, width, num_layers, top_k] on the host (dense layers 0)."""
        out = torch.zeros(batch, width, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, ids in self._ids.items():
            out[:, :, layer] = ids.reshape(batch, width, self.top_k).to("cpu", torch.int32)
        self._ids.clear()
        return out


def encode(rows: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes (C order)."""
    return base64.b64encode(np.ascontiguousarray(rows.numpy(), dtype=np.int32).tobytes()).decode("ascii")
