"""MoE routing replay (`--use-routing-replay`, `--use-rollout-routing-replay`): the trainer's MoE layers send
each token to the experts chosen elsewhere instead of choosing themselves.

Sources of the choices, per pass over packed micro-batches:
- "rollout": the engine's, per sample (`RolloutBatch.rollout_routed_experts`, int32 [len - 1, layers, top-k]
  over the sample's tokens but the last; SGLang's `return_routed_experts`);
- "recorded": the routers' own choices in an earlier pass over the same micro-batches (`record`).
The gate weights are always the current router's scores at the replayed experts (so the router still learns);
only the choice is replayed. Tokens without a replayed choice (padding, a sample's last token, the tokens of a
tool turn that ends a sample after the engine's last request, MTP layers) are routed by the router.

The choices reach a layer through `REPLAY`: the trainer calls `begin_micro_batch(mb)` before each micro-batch's
forward; a layer's forward that runs during backward (activation recompute) takes the micro-batch of its
earliest forward not yet recomputed (megatron's schedules run backward in forward order, per layer).
"""

from __future__ import annotations

from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Any, Callable, Sequence

import torch


class RoutingReplayError(RuntimeError):
    """Replayed routes that do not fit the micro-batch. One line: which and why."""


class RoutingReplay:
    def __init__(self) -> None:
        self.mode: str | None = None  # None: routers choose; "record"; "replay"
        self.source: str | None = None  # replay: "rollout" | "recorded"
        self.batch: Any = None  # the RolloutBatch of a "rollout" replay
        self.layout: dict[str, int] = {}  # tp_rank, tp_size (sequence parallel), filled by the trainer
        self.recorded: dict[tuple, dict[int, torch.Tensor]] = {}
        self._current: tuple | None = None
        self._routes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[int, deque] = defaultdict(deque)
        self._mb: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ the trainer's side
    @contextmanager
    def recording(self):
        """A pass whose routers choose, and whose choices are kept per micro-batch for a later `replaying`."""
        self.recorded = {}
        with self._pass("record", None):
            yield

    @contextmanager
    def replaying(self, source: str, batch: Any = None):
        if source not in ("rollout", "recorded"):
            raise ValueError(f"routing replay source {source!r}: use 'rollout' or 'recorded'")
        if source == "rollout" and (batch is None or batch.rollout_routed_experts is None):
            raise RoutingReplayError("--use-rollout-routing-replay: the rollout carries no routed experts (the "
                                     "engines must return them: return_routed_experts); check the engine")
        self.batch = batch
        with self._pass("replay", source):
            yield

    @contextmanager
    def _pass(self, mode: str, source: str | None):
        self.mode, self.source = mode, source
        try:
            yield
        finally:
            self.mode = self.source = self._current = None
            self._routes.clear()
            self._pending.clear()
            self._mb.clear()
            self.batch = None

    def begin_micro_batch(self, mb: Any) -> None:
        if self.mode is None:
            return
        key = tuple(mb.sample_indices)
        self._current = key
        self._mb[key] = mb

    # ------------------------------------------------------------------ the MoE layers' side
    def _key(self, layer: int) -> tuple:
        if torch._C._current_graph_task_id() != -1:  # a forward run by backward: activation recompute
            if not self._pending[layer]:
                raise RoutingReplayError(f"MoE layer {layer} is recomputed in backward but had no forward to replay")
            return self._pending[layer].popleft()
        if self._current is None:
            raise RoutingReplayError("routing replay is on but no micro-batch was begun (begin_micro_batch)")
        # kept for a recompute of this forward in backward (megatron's checkpoint runs it without grad first)
        self._pending[layer].append(self._current)
        return self._current

    def choice(self, layer: int | None, num_tokens: int, device: torch.device):
        """(expert ids int64 [T, k], replayed bool [T]) for this layer's local tokens, or None (routers choose)."""
        if self.mode != "replay" or layer is None:
            return None
        key = self._key(layer)
        if self.source == "recorded":
            ids = self.recorded.get(key, {}).get(layer)
            if ids is None:
                raise RoutingReplayError(f"--use-routing-replay: micro-batch of samples {list(key)[:8]} was not recorded "
                                         f"for MoE layer {layer} (the log-prob pass packs the training micro-batches)")
            ids = ids.to(device)
            return ids, torch.ones(ids.shape[0], dtype=torch.bool, device=device)
        if key not in self._routes:
            self._routes[key] = self._rollout_routes(self._mb[key])
        ids, valid = self._routes[key]
        if layer >= ids.shape[1]:
            raise RoutingReplayError(f"the rollout's routed experts cover {ids.shape[1]} layers; MoE layer {layer} "
                                     "is beyond them (engine and trainer models differ)")
        if ids.shape[0] != num_tokens:
            raise RoutingReplayError(f"MoE layer {layer} sees {num_tokens} tokens but the replayed routes cover "
                                     f"{ids.shape[0]}; this is a bug")
        return ids[:, layer].to(device=device, dtype=torch.long), valid.to(device)

    def record(self, layer: int | None, ids: torch.Tensor) -> None:
        if self.mode != "record" or layer is None:
            return
        if self._current is None:
            raise RoutingReplayError("routing replay records but no micro-batch was begun (begin_micro_batch)")
        self.recorded.setdefault(self._current, {})[layer] = ids.detach().to("cpu", torch.int32)

    def _rollout_routes(self, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's routes laid out as this rank's tokens of packed micro-batch `mb` sit (its CP chunks,
        then its sequence-parallel slice): (ids int32 [T_local, layers, k], replayed bool [T_local])."""
        routes = self.batch.rollout_routed_experts
        first = torch.as_tensor(routes[mb.sample_indices[0]])
        ids, valid = rows_as_packed(routes, self.batch.tokens, mb, tuple(first.shape[1:]), 0, lambda i, shape, n: (
            RoutingReplayError(f"sample {i}: routed experts of shape {shape} for {n} tokens; expected "
                               f"({n - 1}, {first.shape[1]}, {first.shape[2]})")))
        tp = self.layout.get("sp_size", 1)
        if tp > 1:
            rank = self.layout["tp_rank"]
            ids, valid = ids.chunk(tp)[rank], valid.chunk(tp)[rank]
        return ids, valid


NOT_FED = -2
"""The value of every slot of a row the engine never recorded: the tokens after its last request's (a tool or
environment turn that ends the sample; slime.rollout.train_payload fills them). No expert id or key position is
negative but -1 (an unused indexer slot), so such a row cannot be an engine's."""


def rows_as_packed(per_sample: Sequence[Any], tokens: Sequence[Sequence[int]], mb: Any, inner: tuple[int, ...],
                   fill: int, misfit: Callable[[int, tuple[int, ...], int], Exception]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows an engine recorded per fed token (sample i's: int32 [len - 1, *inner], every token but the last) laid
    out as this rank's tokens of packed micro-batch `mb` (its context-parallel chunks): (rows int32
    [T_local, *inner], bool [T_local]: the token has a recorded row); each sample's last token, its NOT_FED rows
    and the padding hold `fill` and keep the trainer's own choice. `misfit(i, shape, tokens)`: the error for
    sample i's rows of another shape. Routing replay and indexer top-k replay (slime.utils.indexer_replay) both lay
    out their payloads with it."""
    total = int(mb.tokens.shape[-1])
    ids = torch.full((total, *inner), fill, dtype=torch.int32)
    valid = torch.zeros(total, dtype=torch.bool)
    starts = mb.cu_seqlens.tolist()
    for j, i in enumerate(mb.sample_indices):
        rows, n = torch.as_tensor(per_sample[i], dtype=torch.int32), len(tokens[i])
        if rows.ndim != len(inner) + 1 or rows.shape[0] != n - 1 or (n > 1 and tuple(rows.shape[1:]) != inner):
            raise misfit(i, tuple(rows.shape), n)
        if n > 1:  # a one-token sample has no rows (and its empty ones may be laid out otherwise)
            fed = ~(rows.reshape(n - 1, -1) == NOT_FED).all(1) if rows[0].numel() else torch.ones(n - 1, dtype=bool)
            ids[starts[j]:starts[j] + n - 1] = torch.where(fed.reshape(-1, *[1] * len(inner)), rows, fill)
            valid[starts[j]:starts[j] + n - 1] = fed
    if mb.cp is not None:
        local = mb.cp.local_index.cpu()
        ids, valid = ids[local], valid[local]
    return ids, valid


REPLAY = RoutingReplay()
