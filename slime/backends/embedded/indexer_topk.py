"""The keys each DSA layer of the engine's GLM-5.3-Flash (glm5_next) attended over, per token, as SGLang 0.5.23
names them (`return_indexer_topk`, `meta_info["indexer_topk"]`); the layout is slime/utils/indexer_replay.py's:
int32 [rows, num_hidden_layers, width], one row per token of prompt + response but the last, key positions
counted from the sequence's first token, a "shared" layer's slot a copy of its full layer's, KDA layers -1.

transformers' `Glm5NextTextIndexer.forward(hidden, q_resid, attention_mask, cache) -> int32 [B, S, width]` returns
raw cache columns: in the engine's left-padded batches a row's columns start after its padding, so the capture
subtracts each row's padding (the attention mask's zeros; the mask spans the whole cache in decode steps too).
A forward hook on each indexer keeps the current forward's selection while capturing is on.
"""

from __future__ import annotations

from typing import Any

import torch


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class IndexerCapture:
    def __init__(self, model: torch.nn.Module) -> None:
        config = _text_config(model.config)
        self.num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        self.enabled = False
        self._rows: dict[int, torch.Tensor] = {}
        self.sources: dict[int, int] = {}  # DSA layer -> the full layer whose selection it uses
        self.width = 0
        for module in model.modules():
            if type(module).__name__ == "Glm5NextTextIndexer":
                module.register_forward_hook(self._hook(int(module.layer_idx)))
                self.width = int(module.index_topk) + (int(module.index_kpool) - 1
                                                       if module.index_kpool_always_select_tail else 0)
        layer_types = list(getattr(config, "layer_types", None) or [])
        indexer_types = list(getattr(config, "indexer_types", None) or [])
        for layer, kind in enumerate(layer_types[: self.num_layers]):
            if kind != "indexed_attention":
                continue
            source = layer
            while source > 0 and indexer_types[source] == "shared" and layer_types[source - 1] == "indexed_attention":
                source -= 1
            self.sources[layer] = source

    @property
    def available(self) -> bool:
        return self.width > 0 and bool(self.sources)

    def _hook(self, layer: int):
        def keep(module: Any, inputs: Any, output: torch.Tensor) -> None:
            if self.enabled:
                self._rows[layer] = output.detach()
        return keep

    def take(self, mask: torch.Tensor, fed: int) -> torch.Tensor:
        """The last forward's selections of its `fed` newest columns as int32 [batch, fed, num_layers, width] on
        the host, in sequence positions (`mask`: the forward's left-padded attention mask over the whole cache)."""
        batch = mask.shape[0]
        pad = (mask.shape[1] - mask.sum(-1)).to("cpu", torch.int32)[:, None, None]
        out = torch.full((batch, fed, self.num_layers, self.width), -1, dtype=torch.int32)
        for layer, source in self.sources.items():
            rows = self._rows.get(source)
            if rows is None:  # (no indexer ran: nothing to report for this forward)
                continue
            rows = rows.reshape(batch, fed, self.width).to("cpu", torch.int32)
            out[:, :, layer] = torch.where(rows >= 0, rows - pad, rows)
        self._rows.clear()
        return out


def extend(previous: torch.Tensor | None, new: torch.Tensor, fed: int, length: int) -> torch.Tensor:
    """A request's per-token rows (these DSA keys, or the routers' experts: routed_experts.py) after a forward
    that fed `fed` columns of a left-padded batch (`new`: its [fed, ...] rows): a decode step (fed 1) appends its
    token's row; a (re-)prefill gives its whole sequence of `length` tokens, right-aligned."""
    if fed == 1 and previous is not None:
        return torch.cat([previous, new])
    return new[fed - length:].clone()
