"""Colocated transport into an embedded engine's weight sets (one copy per byte, where the shared buckets of
tensor_handles.py cost two).

For one engine that offers weight sets (`"weight_sets"` in /get_model_info lists the export's expert
layout: the embedded engine in one process on host memory): the engine's weights live in two shared
buffers this rank allocates once (slime.backends.embedded.weight_sets); each exported tensor is copied
once, straight into its place in the set the engine does not read, in the engine's layout (expert weights
in megatron's [in, out] order, so no transpose), and `/commit_weight_sets` switches the engine to it, all
or nothing (checked against the written bytes' checksums with --check-weight-sync).
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron.weight_sync.common import (EngineEndpoint, SyncRound, WeightSyncError, check_reply,
                                                        first_line)
from slime.utils import weight_checksum

class WeightSetWriter:
    """The trainer's side of an engine's weight sets (slime.backends.embedded.weight_sets): two shared uint8
    buffers in the engine's layout that the engine's weights live in. Each exported tensor is copied once,
    straight into its place in the set the engine does not read (its target); the engine switches to it
    when the update is committed. With the engine's "in_out" expert layout the export's transposed expert
    views land in storage of their own layout: rows are copied, not transposed."""

    reuse = True  # kept across syncs (WeightSetTransport keeps one per engine process)

    def __init__(self, layout: dict[str, Any], device: torch.device,
                 share: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.layout_id = str(layout["layout_id"])
        self.set_bytes = int(layout["set_bytes"])
        self.entries: dict[str, list] = layout["tensors"]
        self.sets = []
        for _ in range(2):
            flat = torch.empty(self.set_bytes, dtype=torch.uint8, device=device)
            if share is not None:
                share(flat)
            flat.zero_()  # touched once here, not at every sync's first write
            self.sets.append(flat)
        self._typed: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]
        self.targets: list[int] = []
        self.epoch: Any = None
        self.names: list[str] = []
        self._run: list | None = None  # (source, target) pairs to copy together (see flush)

    def begin(self, state: dict[str, Any]) -> None:
        """Start an update from the engine's state: its epoch and, per tensor, the set to write."""
        self.targets, self.epoch, self.names, self._run = list(state["targets"]), state["epoch"], [], None

    def view(self, name: str) -> torch.Tensor:
        """Where `name` goes in this update (a view of its target set)."""
        entry = self.entries.get(name)
        if entry is None:
            raise ValueError(f"the engine's weight sets have no weight {name}")
        region, offset, shape, stride, dtype_name = entry
        dtype = getattr(torch, dtype_name)
        target = self.targets[region]
        typed = self._typed[target].get(dtype)
        if typed is None:
            typed = self._typed[target][dtype] = self.sets[target].view(dtype)
        return typed.as_strided(shape, stride, offset // dtype.itemsize)

    def add(self, name: str, t: torch.Tensor) -> None:
        dst = self.view(name)
        if t.dtype != dst.dtype or t.shape != dst.shape:
            raise ValueError(f"{name}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)} exported, the engine "
                             f"holds {str(dst.dtype).removeprefix('torch.')} {list(dst.shape)}")
        t = t.detach()
        run = self._run
        if not (run and _same_offset_map(run[0], t, dst)):
            self.flush()
            run = self._run = []
        run.append((t, dst))
        self.names.append(name)

    def flush(self) -> None:
        """Copy the pending run: consecutive tensors whose places in the set are their places in one source
        storage shifted by one offset (with the same strides). When they fill a dense range of it (a layer's
        experts: megatron's [E, H, 2I] weight and the engine's storage of the same layout), the range is
        copied as one contiguous block; else tensor by tensor."""
        run, self._run = self._run, None
        if not run:
            return
        if len(run) > 1:
            lo = min(t.storage_offset() for t, _ in run)
            hi = max(t.storage_offset() + _span(t) for t, _ in run)
            if hi - lo == sum(t.numel() for t, _ in run):
                src, dst = run[0]
                shift = dst.storage_offset() - src.storage_offset()
                dst.as_strided((hi - lo,), (1,), lo + shift).copy_(src.as_strided((hi - lo,), (1,), lo))
                return
        for src, dst in run:
            dst.copy_(src)

    def written(self) -> list[tuple[str, torch.Tensor]]:
        self.flush()
        return [(n, self.view(n)) for n in self.names]


def _span(t: torch.Tensor) -> int:
    """Elements from a view's first to one past its last, in its storage."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0


def _same_offset_map(first: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether (t -> dst) maps storage positions as (first source -> first target) does: same storages,
    strides and offset shift."""
    src0, dst0 = first
    return (t.dtype == src0.dtype and t.stride() == dst.stride() and src0.stride() == dst0.stride()
            and t.untyped_storage().data_ptr() == src0.untyped_storage().data_ptr()
            and dst.untyped_storage().data_ptr() == dst0.untyped_storage().data_ptr()
            and dst.storage_offset() - t.storage_offset() == dst0.storage_offset() - src0.storage_offset())


class WeightSetTransport:
    """The weight-set writers of one WeightSync, one per engine process. `ctx` is the controller
    (slime.backends.megatron.weight_sync.controller.WeightSync): post, check, role."""

    def __init__(self, ctx: Any, expert_layout: str) -> None:
        self.ctx = ctx
        # the layout the export's expert weights come in ("in_out": megatron's [in, out], handed out as
        # transposed views; "hf": contiguous HF tensors)
        self.expert_layout = expert_layout
        self.writers: dict[tuple[str, int], WeightSetWriter] = {}

    def offered_by(self, info: dict[str, Any]) -> bool:
        """Whether an engine's /get_model_info offers weight sets in this export's expert layout."""
        layouts = info.get("weight_sets")
        return isinstance(layouts, list) and self.expert_layout in layouts

    def begin(self, rnd: SyncRound, engine: EngineEndpoint) -> "WeightSetStage":
        """This sync's writer into the engine's weight sets: the sets are allocated and attached once per engine
        process (again when the engine has dropped them, e.g. after releasing its weights)."""
        from slime.accelerator.ipc import serialize_named_tensors

        acc, post = get_accelerator(), self.ctx.post
        key = (engine.url, engine.instance)
        writer = self.writers.get(key)
        state = post(engine, "/weight_sets_state", {"layout_id": writer.layout_id if writer else None})
        check_reply(state, f"weight_sets_state ({engine.url})")
        if not state.get("attached"):
            layout = post(engine, "/weight_sets_layout", {"expert_layout": self.expert_layout})
            check_reply(layout, f"weight_sets_layout ({engine.url})")
            if writer is None or writer.layout_id != layout["layout_id"]:
                writer = None
                self.writers = {}  # the buffers of an engine process that is gone
                writer = WeightSetWriter(layout, acc.device(), share=acc.reduce_tensor)
            handles = base64.b64encode(serialize_named_tensors(acc, [("0", writer.sets[0]), ("1", writer.sets[1])]))
            state = post(engine, "/attach_weight_sets", {"layout_id": writer.layout_id,
                                                         "serialized_named_tensors": [handles.decode()]})
            check_reply(state, f"attach_weight_sets ({engine.url})")
        self.writers = {key: writer}
        writer.begin(state)
        return WeightSetStage(self.ctx, rnd, engine, writer)

    def close(self) -> None:
        self.writers = {}


class WeightSetStage:
    """One sync through an engine's weight sets: every tensor is copied into the engine's target set; `finish`
    commits the update (the engine checks it in full, against the written bytes' checksums when the sync is
    checked, then switches to it). A failure keeps the export going (its collectives) and writes nothing more;
    no commit, so the engine keeps its weights."""

    def __init__(self, ctx: Any, rnd: SyncRound, engine: EngineEndpoint, writer: WeightSetWriter) -> None:
        self.ctx, self.round, self.engine, self.writer = ctx, rnd, engine, writer
        self.error: BaseException | None = None

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        for name, t in bucket:
            if self.error is not None:
                break
            try:
                self.writer.add(name, t)
            except Exception as e:  # noqa: BLE001 - raised by finish(), after the export has run to its end
                self.error = WeightSyncError(f"weight sync to {self.engine.url}: {first_line(e)}; "
                                             "the engine keeps its weights")
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self) -> dict[str, list[int]]:
        if self.error is not None:
            raise self.error
        if self.round.failed is not None:  # e.g. the pause failed: nothing is committed
            raise self.round.failed
        if not self.writer.names:
            return {}
        check = self.ctx.check and self.ctx.role.sender
        self.writer.flush()
        get_accelerator().synchronize()  # the copies are complete before the engine switches to them
        expected = weight_checksum.named_checksums(self.writer.written()) if check else {}
        body: dict[str, Any] = {"layout_id": self.writer.layout_id, "epoch": self.writer.epoch,
                                "names": self.writer.names, "weight_version": str(self.round.version)}
        if check:
            body.update(checksums=expected, return_checksums=True)
        reply = self.ctx.post(self.engine, "/commit_weight_sets", body)
        check_reply(reply, f"commit_weight_sets ({self.engine.url})")
        if check and isinstance(reply, dict):
            self.round.report(self.engine.url, reply.get("checksums"))
        return expected

    def abandon(self) -> None:
        """The export failed: nothing was committed, the engine keeps its weights."""
