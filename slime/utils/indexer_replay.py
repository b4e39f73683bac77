"""DSA indexer top-k replay (`--use-rollout-indexer-replay`): the trainer's GLM-5.3-Flash (glm5_next) DSA layers
attend over the keys the rollout engine's lightning indexer selected for each token, instead of selecting
themselves.

The payload (SGLang 0.5.23's names: request field `return_indexer_topk`, `meta_info["indexer_topk"]`, base64 of
int32 bytes in C order) is one row per token the engine fed, i.e. every token of prompt + response but the last,
laid out [rows, num_hidden_layers, width]: one slot per decoder layer (SGLang's `get_num_indexer_layers` for
DSA models), a "shared" layer's slot mirroring the full layer it reuses, KDA layers' slots -1. A row holds the
selected key positions of that token, counted from the sequence's first token, in the indexer's column layout
(`ops.kpool_indexer`, transformers' Glm5NextTextIndexer): the best pools' tokens first, then with
index_kpool_always_select_tail the visible incomplete pool, -1 in unused slots; width = index_topk
(+ index_kpool - 1 with the tail). Prompt tokens are recorded too (the engine's prefill runs the indexer over
them), so every position whose log-prob is trained attends over exactly the rollout's keys; the tokens never fed
to the engine (each sample's last, and a tool turn that ends the sample after the engine's last request: their
rows are NOT_FED, slime.utils.routing_replay) and padding keep the trainer's own selection (nothing trained reads
them: they only shape their own, loss-masked, log-probs).

Trainer side: `INDEXER_REPLAY.replaying(batch)` around the log-prob and training passes; `selection(mb)` lays
the rollout's rows out as the micro-batch's tokens sit on this rank (its context-parallel chunks; the DSA layers
gather sequence-parallel slices before the indexer, so no SP split) and the model hands them to its DSA layers
through its ForwardContext, which activation recompute reuses.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from slime.utils.routing_replay import rows_as_packed

META_KEY = "indexer_topk"
REQUEST_FIELD = "return_indexer_topk"


class IndexerReplayError(RuntimeError):
    """Replayed selections that do not fit. One line: which and why."""


def rows_from_meta(flat: torch.Tensor, rows: int, layers: int, sample: Any = "?") -> torch.Tensor:
    """A flat int32 `indexer_topk` of `rows` tokens x `layers` layers -> int32 [rows, layers, width]."""
    per_row = rows * layers
    if per_row == 0:
        if flat.numel():
            raise ValueError(f"sample {sample}: indexer_topk has {flat.numel()} values for {rows} tokens")
        return flat.reshape(rows, layers, 0).to(torch.int32)
    if flat.numel() % per_row:
        raise ValueError(f"sample {sample}: indexer_topk has {flat.numel()} values, not a multiple of {rows} tokens "
                         f"x {layers} layers (engine and --num-layers disagree, or rows are missing)")
    return flat.reshape(rows, layers, flat.numel() // per_row).to(torch.int32)


def encode(rows: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes (C order)."""
    import base64

    import numpy as np

    return base64.b64encode(np.ascontiguousarray(rows.numpy(), dtype=np.int32).tobytes()).decode("ascii")


class IndexerReplay:
    def __init__(self) -> None:
        self.batch: Any = None  # the RolloutBatch being replayed; None: the layers select by themselves

    @contextmanager
    def replaying(self, batch: Any):
        if batch.rollout_indexer_topk is None:
            raise IndexerReplayError("--use-rollout-indexer-replay: the rollout carries no indexer top-k (the engines "
                                     "must return it: return_indexer_topk); check the engine")
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    def selection(self, mb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions int32 [T_local, layers, width], replayed bool [T_local]) of packed micro-batch `mb` on this
        rank, or None when not replaying."""
        if self.batch is None:
            return None
        topk = self.batch.rollout_indexer_topk
        shapes = {tuple(torch.as_tensor(topk[i]).shape[1:]) for i in mb.sample_indices
                  if len(self.batch.tokens[i]) > 1}
        if len(shapes) > 1:
            raise IndexerReplayError(f"indexer top-k of different layouts in one micro-batch: {sorted(shapes)}")
        inner = shapes.pop() if shapes else (0, 0)  # (layers, width)
        return rows_as_packed(topk, self.batch.tokens, mb, inner, -1, lambda i, shape, n: IndexerReplayError(
            f"sample {i}: indexer top-k of shape {shape} for {n} tokens; expected ({n - 1}, layers, width)"))


def replayed(computed: torch.Tensor, replay: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
    """A full DSA layer's selection [T, width] with the rollout's rows in place of the computed ones."""
    ids, valid = replay
    if not bool(valid.any()):
        return computed
    if layer >= ids.shape[1]:
        raise IndexerReplayError(f"the rollout's indexer top-k covers {ids.shape[1]} layers; DSA layer {layer} is "
                                 "beyond them (engine and trainer models differ)")
    if ids.shape[0] != computed.shape[0] or ids.shape[2] != computed.shape[1]:
        raise IndexerReplayError(f"DSA layer {layer} selects [{computed.shape[0]}, {computed.shape[1]}] but the "
                                 f"replayed rows are [{ids.shape[0]}, {ids.shape[2]}] (index_topk / index_kpool / "
                                 "always_select_tail differ between engine and trainer)")
    rows = ids[:, layer].to(device=computed.device, dtype=computed.dtype)
    return torch.where(valid.to(computed.device)[:, None], rows, computed)


INDEXER_REPLAY = IndexerReplay()
