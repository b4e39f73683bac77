"""Weight and memory endpoints of the embedded engine (a mixin of `EmbeddedEngine`): updates by HF name
from IPC tensors, a collective group, safetensors on disk or the trainer's writes into the engine's
shared weight sets (weight_sets.py), each validated in full before any weight changes; memory
release/resume; checksums and model info."""

from __future__ import annotations

from typing import Any

import torch

from slime.backends.embedded.tensor_parallel import RELEASE, RESUME
from slime.backends.embedded.errors import BadRequest
from slime.backends.embedded.weight_sets import LAYOUTS
from slime.backends.embedded.weights import (
    PlannedCopy,
    apply_plan,
    dtype_name,
    parse_dtype,
    plan_disk_update,
    plan_update,
)
from slime.utils.distributed import DEFAULT_TIMEOUT_S


class WeightControl:
    """Needs from the engine: model, device, acc, cfg, name_map, weight_version, _model_lock, _cond,
    _released_weights, _groups, abort_all(), context_length, vocab_size, eos_ids, tp (rank 0's Lockstep or None)."""

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: list[str] | None = None) -> None:
        tags = _check_tags(tags)
        if "weights" not in tags:
            return  # the KV cache lives only for a wave; nothing is held between waves
        with self._cond:
            if self._released_weights is not None:
                return
            self._released_weights = {}
        self.abort_all("aborted by release_memory_occupation")
        from slime.backends.embedded.flattened_bucket import drop_open

        drop_open()  # the trainer's shared buffers, kept open between updates
        sets = self.__dict__.get("_weight_sets")
        if sets is not None:  # released weights live in no set; the trainer attaches the sets again
            with self._model_lock:
                sets.detach()
        self.__dict__.pop("_packed_buffers", None)  # the flattened_bucket receive buffers of distributed updates
        with self._model_lock:
            self._fp8_receipts().clear()  # nothing received is held any more
            for name, p in self.model.named_parameters():
                self._released_weights[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.tp is not None:  # the other TP ranks release theirs
                self.tp.memory(RELEASE, tags)
        self.acc.empty_cache()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        tags = _check_tags(tags)
        if "weights" not in tags or self._released_weights is None:
            return
        with self._model_lock:
            for name, p in self.model.named_parameters():
                shape, dtype = self._released_weights[name]
                # Contents are undefined until the next weight update; NaN makes a missed update visible.
                fill = float("nan") if dtype.is_floating_point else 0
                p.data = torch.full(shape, fill, dtype=dtype, device=self.device)
            if self.tp is not None:
                self.tp.memory(RESUME, tags)
        with self._cond:
            self._released_weights = None
            self._cond.notify_all()

    # ------------------------------------------------------------------ weights
    def _require_weights(self) -> None:
        if self._released_weights is not None:
            raise BadRequest("weights are released; call /resume_memory_occupation with tags [\"weights\"] first")

    def _commit(self, plan: list[PlannedCopy], weight_version: Any, staged: dict | None = None) -> None:
        """Apply a checked plan, with the receipts of its FP8 pairs (`staged`, else computed here before any
        copy: fp8_receipts.py), which replace the receipts of every weight it changes."""
        from slime.backends.embedded.fp8_receipts import stage_receipts

        staged = stage_receipts(plan) if staged is None else staged
        with self._model_lock:
            apply_plan(plan)
            if self.tp is not None:  # tensor parallel: every rank holds the full weights (tensor_parallel.py)
                self.tp.weights_changed([(p.name, p.target) for p in plan])
            self._fp8_receipts().commit([p.name for p in plan], staged)
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def _fp8_receipts(self):
        """What /get_weights_checksum answers for the weights received as block-FP8 pairs (fp8_receipts.py)."""
        from slime.backends.embedded.fp8_receipts import Fp8Receipts

        return self.__dict__.setdefault("_fp8_receipt_book", Fp8Receipts())

    def _fp8_layout(self):
        """The block-FP8 layout of the served checkpoint (its config.json), else e4m3 in 128 x 128 blocks: how an
        update's FP8 weights (X.weight in e4m3 + X.weight_scale_inv, as the sender's fp8_blocks.quantize_named
        writes them for an FP8 engine) are dequantized into this engine's high-precision weights."""
        from slime.backends.embedded.fp8_checkpoint import Fp8Layout, layout_of_dir

        if "_fp8" not in self.__dict__:
            self.__dict__["_fp8"] = layout_of_dir(self.cfg.model_path) or Fp8Layout()
        return self.__dict__["_fp8"]

    def update_from_named_tensors(self, named: list[tuple[str, torch.Tensor]], weight_version: Any = None) -> int:
        plan = self._plan_named(named)
        self._commit(plan, weight_version)
        return len(plan)

    def update_from_named_tensors_checked(self, named: list[tuple[str, torch.Tensor]],
                                          weight_version: Any = None) -> tuple[int, dict[str, list[int]]]:
        """update_from_named_tensors, also answering slime.utils.weight_checksum of every tensor as received,
        under the names it was sent by: what the sender checksums (the bytes it sent), so an FP8 pair counts as
        its e4m3 weight and its weight_scale_inv, not as the dequantized weight this engine keeps (the pair's
        receipt, which /get_weights_checksum answers later too). Computed before the commit, so an update is
        applied with its checksums or not at all; the other tensors land byte for byte (plan_update refuses
        any cast)."""
        from slime.backends.embedded.fp8_receipts import received_checksums, stage_receipts
        from slime.utils.weight_checksum import named_checksums

        plan = self._plan_named(named)
        staged = stage_receipts(plan)
        received = received_checksums(staged)
        sums = {**named_checksums((n, t) for n, t in named if n not in received), **received}
        self._commit(plan, weight_version, staged)
        return len(plan), {n: sums[n] for n, _ in named}

    def _plan_named(self, named: list[tuple[str, torch.Tensor]]) -> list[PlannedCopy]:
        """The checked copies of an update by name (FP8 pairs dequantized); BadRequest, nothing changed."""
        from slime.backends.embedded.fp8_checkpoint import FLOAT8, dequantize_named
        from slime.backends.embedded.fp8_receipts import mark_received
        from slime.utils.fp8_blocks import SCALE_SUFFIX

        self._require_weights()
        names, sent = self.name_map, dict(named)
        named = dequantize_named(named, self._fp8_layout(), "weight update rejected, nothing changed",
                                 lambda n: names.resolve(n).dtype if n in names else torch.float32)
        plan = plan_update(self.name_map, [(n, t.shape, t.dtype) for n, t in named])
        for p, (_, t) in zip(plan, named):
            p.source = t
        mark_received(plan, {p.name: (p.name + SCALE_SUFFIX, sent[p.name], sent[p.name + SCALE_SUFFIX])
                             for p in plan if sent[p.name].dtype in FLOAT8})
        return plan

    def update_from_disk(self, model_path: str, weight_version: Any = None) -> int:
        self._require_weights()
        from slime.backends.embedded.fp8_checkpoint import layout_of_dir

        layout = layout_of_dir(model_path) if isinstance(model_path, str) else None
        plan = plan_disk_update(self.name_map, model_path, layout or self._fp8_layout())
        self._commit(plan, weight_version)
        return len(plan)

    # ------------------------------------------------------------------ weight sets (weight_sets.py)
    def _sets(self, layout_id: Any):
        sets = self.__dict__.get("_weight_sets")
        if sets is None or layout_id != sets.layout_id:
            raise BadRequest(f"no weight sets of layout {layout_id!r}; ask /weight_sets_layout and attach them")
        return sets

    def weight_sets_layout(self, expert_layout: Any = "hf") -> dict[str, Any]:
        """The layout of this engine's weight sets (kept while its expert layout is asked for again)."""
        from slime.backends.embedded.weight_sets import WeightSets

        self._require_weights()
        if not self.weight_sets_supported():
            raise BadRequest("weight sets need a single-process engine on host memory; use load_format "
                             "flattened_bucket")
        sets = self.__dict__.get("_weight_sets")
        if sets is None or sets.expert_layout != expert_layout:
            sets = self.__dict__["_weight_sets"] = WeightSets(self.name_map, expert_layout)
        return sets.layout()

    def attach_weight_sets(self, layout_id: Any, buffers: list[torch.Tensor]) -> dict[str, Any]:
        self._require_weights()
        with self._model_lock:
            sets = self._sets(layout_id)
            sets.attach([b for b in buffers])
            return sets.state()

    def weight_sets_state(self, layout_id: Any) -> dict[str, Any]:
        sets = self.__dict__.get("_weight_sets")
        if self._released_weights is not None or sets is None or layout_id != sets.layout_id:
            return {"attached": False}
        with self._model_lock:
            return sets.state()

    def commit_weight_sets(self, layout_id: Any, epoch: Any, names: Any, weight_version: Any = None,
                           checksums: Any = None, return_checksums: bool = False) -> dict[str, Any]:
        """Switch the named weights to what the trainer wrote into their target set: checked in full first
        (and against `checksums` of the trainer's, when given), else nothing changes."""
        from slime.utils.weight_checksum import mismatches, named_checksums

        self._require_weights()
        with self._model_lock:
            sets = self._sets(layout_id)
            names, touched = sets.prepare(names, epoch)
            sums = named_checksums(sets.target_views(names)) if checksums is not None or return_checksums else None
            if checksums is not None:
                if not isinstance(checksums, dict):
                    raise BadRequest("checksums must be an object {name: checksum}")
                bad = mismatches({n: checksums[n] for n in names if n in checksums}, sums)
                if bad:
                    raise BadRequest(f"weight update rejected, nothing changed: {len(bad)} weights differ from "
                                     f"the trainer's checksums (first: {bad[:3]})")
            sets.switch(touched)
            self._fp8_receipts().drop(names)  # these weights are now the trainer's high-precision writes
            if weight_version is not None:
                self.weight_version = str(weight_version)
            out = {"updated": len(names), **sets.state()}
        if return_checksums:
            out["checksums"] = sums
        return out

    def weight_sets_supported(self) -> bool:
        return self.tp is None and getattr(self, "tp_size", 1) == 1 and self.acc.memory_is_host()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None) -> None:
        from slime.utils.distributed import init_custom_process_group

        if not isinstance(group_name, str) or not group_name:
            raise BadRequest("group_name must be a non-empty string")
        if group_name in self._groups:
            raise BadRequest(f"weights update group {group_name!r} already exists; destroy it first")
        for k, v in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise BadRequest(f"{k} must be a non-negative int, got {v!r}")
        if not 1 <= rank_offset < world_size:
            raise BadRequest(f"rank_offset {rank_offset} must be in [1, world_size={world_size}) (rank 0 is the trainer)")
        self._groups[group_name] = init_custom_process_group(
            master_address=str(master_address), master_port=master_port, world_size=world_size,
            rank=rank_offset, group_name=group_name, backend=backend)

    def update_from_distributed(self, names: Any, dtypes: Any, shapes: Any, group_name: str,
                                weight_version: Any = None, load_format: Any = None, sequence: Any = None) -> int:
        """Receive every tensor (broadcast from group rank 0), then apply all or nothing. Tensors are received
        even when the update will be rejected, so the sender never hangs.

        load_format None: one broadcast per tensor, in `names` order. "flattened_bucket" (SGLang's bucketed
        form): one broadcast of the tensors' bytes packed in `names` order without gaps (SGLang's
        FlattenedTensorBucket layout), received into one of two buffers this engine keeps per group.

        `sequence` (slime's extension, `"distributed_sequence": true` in /get_model_info): the update's number
        on its group, counted from 0 since the group was formed. A sender that numbers its updates may post
        update n + 1 while update n still copies its weights: its receive waits for update n's (the group's
        broadcasts stay in order), and it fills the other buffer, so it overlaps n's copy."""
        from slime.utils.distributed import broadcast

        if group_name not in self._groups:
            raise BadRequest(f"no weights update group {group_name!r}; call /init_weights_update_group first")
        flat = load_format == "flattened_bucket"
        turn = None
        try:
            if sequence is not None:
                if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 0:
                    raise BadRequest(f"sequence must be a non-negative int, got {sequence!r}")
                turn = self._receive_turn(group_name, sequence)
            if load_format not in (None, "direct", "auto", "flattened_bucket"):
                raise BadRequest(f"update_weights_from_distributed: load_format {load_format!r} is not supported; "
                                 "use null or \"flattened_bucket\"")
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                    and len(names) == len(dtypes) == len(shapes) and names):
                raise BadRequest("names, dtypes and shapes must be non-empty lists of equal length")
            try:
                specs = [(n, [int(d) for d in shape], parse_dtype(dt)) for n, shape, dt in zip(names, shapes, dtypes)]
                if any(d < 0 for _, shape, _ in specs for d in shape):
                    raise ValueError("negative dimension")
            except (TypeError, ValueError) as e:
                raise BadRequest(f"bad shapes/dtypes in update_weights_from_distributed: {e}") from e
            if turn is not None:
                turn.wait()  # the updates before this one on the group have received theirs
            if flat:
                recv, sources = self._packed_receive(group_name, specs, 0 if sequence is None else sequence % 2)
            else:
                sources = [torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in specs]
        except BadRequest as e:
            # The sender is about to broadcast tensors this engine cannot receive: leave the group, which
            # closes its connections, so the sender's pending broadcast fails now instead of at its timeout.
            if group_name in self._groups:
                self.destroy_weights_update_group(group_name)
            raise BadRequest(f"{e} (left weights update group {group_name!r})") from None
        error: BadRequest | None = None
        plan: list[PlannedCopy] = []
        fp8_scales: dict[str, str] = {}  # FP8 weight -> its scale: received as sent, dequantized after
        try:
            self._require_weights()
            wanted, fp8_scales = self._fold_fp8(specs)
            plan = plan_update(self.name_map, wanted)
        except BadRequest as e:
            error = e
        group = self._groups[group_name]
        try:
            for b in ([recv] if flat else sources):
                broadcast(b, src=0, group=group)
        finally:
            if turn is not None:
                turn.done()  # the next update on the group may receive (into the other buffer)
        if error is not None:
            raise error
        if flat:
            sources = [v() for v in sources]
        self._fill_received(plan, {n: b for (n, _, _), b in zip(specs, sources)}, fp8_scales)
        self._commit(plan, weight_version)
        return len(plan)

    def _fill_received(self, plan: list[PlannedCopy], received: dict[str, torch.Tensor],
                       fp8_scales: dict[str, str]) -> None:
        """Each planned copy's source from the received tensors, an FP8 pair dequantized (its checksums as
        received noted first: fp8_receipts.py)."""
        from slime.backends.embedded.fp8_checkpoint import dequantized
        from slime.backends.embedded.fp8_receipts import mark_received

        mark_received(plan, {w: (s, received[w], received[s]) for w, s in fp8_scales.items()})
        for p in plan:
            p.source = received[p.name]
            if p.name in fp8_scales:
                p.source = dequantized(p.source, received[fp8_scales[p.name]], self._fp8_layout(), p.name)

    def _fold_fp8(self, specs: list[tuple[str, list[int], torch.dtype]]):
        """(specs as the weights they update, {FP8 weight: its scale}): a block-FP8 pair (the sender's
        quantize_named) counts as its weight in the model's dtype; BadRequest for a malformed pair."""
        from slime.backends.embedded.fp8_checkpoint import FLOAT8, fold_scales
        from slime.utils.fp8_blocks import SCALE_SUFFIX

        if not any(dt in FLOAT8 or n.endswith(SCALE_SUFFIX) for n, _, dt in specs):
            return specs, {}
        folded, pairs = fold_scales(specs, self._fp8_layout(), "weight update rejected, nothing changed")
        names = self.name_map
        return [(n, shape, names.resolve(n).dtype if n in pairs and n in names else dt)
                for n, shape, dt in folded], pairs

    def _receive_turn(self, group_name: str, sequence: int) -> "_ReceiveTurn":
        """Update `sequence`'s turn to receive on the group (see update_from_distributed)."""
        with self._cond:
            orders = self.__dict__.setdefault("_receive_order", {})
            order = orders.get(group_name)
            if order is None or order.group is not self._groups.get(group_name):
                order = orders[group_name] = _ReceiveOrder(self._groups.get(group_name))
        return _ReceiveTurn(order, group_name, sequence)

    def _packed_receive(self, group_name: str, specs: list[tuple[str, list[int], torch.dtype]], index: int = 0):
        """Receive buffer `index` (of two) for a flattened_bucket broadcast of `specs` (per group, as pipeline
        stages send concurrently over their own groups; kept and grown across updates) and,
        per tensor, a function giving it from the received bytes (a view; a copy where SGLang's gapless
        packing leaves it unaligned for its dtype)."""
        import math

        spans, off = [], 0
        for _, shape, dt in specs:
            n = math.prod(shape) * dt.itemsize
            spans.append((off, off + n))
            off += n
        buffers = self.__dict__.setdefault("_packed_buffers", {})
        key = (group_name, index)
        buf = buffers.get(key)
        if buf is None or buf.numel() < off:
            buffers[key] = buf = torch.empty(max(off, 1), dtype=torch.uint8, device=self.device)
        recv = buf[:off]

        def source(start: int, end: int, shape: list[int], dt: torch.dtype):
            part = recv[start:end]
            return lambda: (part if start % dt.itemsize == 0 else part.clone()).view(dt).view(shape)

        return recv, [source(a, b, shape, dt) for (a, b), (_, shape, dt) in zip(spans, specs)]

    def destroy_weights_update_group(self, group_name: str) -> None:
        from slime.utils.distributed import destroy_custom_process_group

        group = self._groups.pop(group_name, None)
        if group is None:
            raise BadRequest(f"no weights update group {group_name!r}")
        for index in (0, 1):
            self.__dict__.get("_packed_buffers", {}).pop((group_name, index), None)
        order = self.__dict__.get("_receive_order", {}).pop(group_name, None)
        if order is not None:  # updates waiting for their turn on this group give up
            order.close()
        destroy_custom_process_group(group)

    def weights_checksum(self, names: Any) -> dict[str, list[int]]:
        """slime.utils.weight_checksum of each named weight (HF or runtime names), to verify a sync; a weight
        received as a block-FP8 pair, and its weight_scale_inv, as the sender checksummed them (fp8_receipts.py)."""
        from slime.utils.weight_checksum import named_checksums

        self._require_weights()
        if names is None:
            names = self.name_map.checkpoint_names()
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("names must be a list of weight names (or omitted for all)")
        receipts = self._fp8_receipts()
        with self._model_lock:
            unknown = [n for n in names if n not in self.name_map and receipts.weight_of(n) is None]
            if unknown:
                raise BadRequest(f"unknown weights {unknown[:3]}{' ...' if len(unknown) > 3 else ''}")
            return receipts.answer(names, lambda weights: named_checksums((n, self.name_map.resolve(n))
                                                                          for n in weights))

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """A weight (HF or runtime name) as float32 nested lists, first dimension cut to `truncate_size`."""
        self._require_weights()
        if name not in self.name_map:
            raise BadRequest(f"unknown weight {name!r}; use an HF checkpoint name or a runtime parameter name")
        with self._model_lock:
            t = self.name_map.resolve(name).detach().to("cpu", torch.float32)
        return t.numpy().tolist()[:truncate_size] if t.dim() else t.item()

    def model_info(self) -> dict[str, Any]:
        main = self._main_dtype()
        return {
            "model_path": self.cfg.model_path,
            "tokenizer_path": self.cfg.tokenizer_path or self.cfg.model_path,
            "is_generation": True,
            "engine": "embedded",
            "device": str(self.device),
            "dtype": dtype_name(main),
            "weight_dtypes": self.name_map.dtype_overrides(main) if self._released_weights is None else {},
            "weight_version": self.weight_version,
            "max_context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "max_running_requests": self.cfg.max_running_requests,
            "eos_token_ids": sorted(self.eos_ids),
            "weights_checksum": True,  # serves /get_weights_checksum (the trainer's post-sync check)
            # takes load_format flattened_bucket (slime's layout) and has copied out of the shared buffers when
            # it replies, so a sender may refill them (slime.backends.megatron.weight_sync.shared_buckets)
            "flattened_bucket": True,
            # the weights can live in two shared sets the trainer writes directly (weight_sets.py), in these
            # expert layouts; empty when not offered (tensor parallel over processes, device memory)
            "weight_sets": list(LAYOUTS) if self.weight_sets_supported() else [],
            # /update_weights_from_tensor with "return_checksums": true answers with the checksums of the tensors as
            # received (an FP8 pair as its e4m3 weight and scale: the bytes the sender checksums)
            "update_checksums": True,
            # /update_weights_from_distributed takes load_format flattened_bucket (one broadcast per update)
            "distributed_flattened_bucket": True,
            # ... and a "sequence" number per update on its group: update n + 1 may be posted while n copies
            "distributed_sequence": True,
            # a batched /generate with one sampling_params object seeds item i with sampling_seed + i
            "batch_item_seeds": True,
        }

    def _main_dtype(self) -> torch.dtype:
        counts: dict[torch.dtype, int] = {}
        for p in self.model.parameters():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        return max(counts, key=counts.get) if counts else torch.float32


class _ReceiveOrder:
    """A group's numbered updates: `next`, the number whose turn it is to receive, under `cond`; `group` is
    the group the numbers count on, None once it is destroyed."""

    def __init__(self, group: Any) -> None:
        import threading

        self.group, self.next, self.cond = group, 0, threading.Condition()

    def close(self) -> None:
        with self.cond:
            self.group = None
            self.cond.notify_all()


class _ReceiveTurn:
    """Update `sequence` of a group waits until the group's updates before it have received their broadcasts
    (`wait`), and lets the next one go once it has received its own (`done`). A destroyed group, or a turn not
    come within the group's timeout (DEFAULT_TIMEOUT_S, the one it is formed with), ends the wait with
    BadRequest."""

    TIMEOUT_S = DEFAULT_TIMEOUT_S

    def __init__(self, order: _ReceiveOrder, group_name: str, sequence: int) -> None:
        self.order, self.group_name, self.sequence = order, group_name, sequence

    def wait(self) -> None:
        import time

        order, deadline = self.order, time.monotonic() + self.TIMEOUT_S
        with order.cond:
            while order.group is not None and order.next < self.sequence:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BadRequest(f"update {self.sequence} on group {self.group_name!r}: update {order.next} "
                                     f"before it never arrived within {self.TIMEOUT_S:.0f} s")
                order.cond.wait(left)
            if order.group is None:
                raise BadRequest(f"weights update group {self.group_name!r} was destroyed while update "
                                 f"{self.sequence} waited for its turn")
            if order.next != self.sequence:
                raise BadRequest(f"update {self.sequence} on group {self.group_name!r} arrived after update "
                                 f"{order.next}: the sender numbers its updates from 0 since the group was formed")

    def done(self) -> None:
        with self.order.cond:
            if self.order.next == self.sequence:
                self.order.next += 1
            self.order.cond.notify_all()


def _check_tags(tags: Any) -> list[str]:
    valid = ["weights", "kv_cache", "cuda_graph"]
    if tags is None:
        return valid
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest("tags must be a list of strings")
    bad = sorted(set(tags) - set(valid))
    if bad:
        raise BadRequest(f"unknown memory tags {bad}; use {valid}")
    return tags
