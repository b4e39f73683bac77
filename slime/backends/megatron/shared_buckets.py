"""Colocated weight sync through reused shared buffers: each exported byte is copied once on the sender.

The export yields full HF tensors (often views of the trainer's parameters); `SharedBucketSender.add`
copies each one straight into its slot of a flat per-dtype buffer that is shared with the engines
once (an IPC handle / shared-memory segment per buffer, not per tensor). When a buffer is full, the
packed set is posted to every engine from a worker thread while the export fills the other set
(double buffering); a set is written again only after every engine has answered the post that read it.

Engines that advertise `"flattened_bucket": true` in `/get_model_info` (the embedded engine) take the
set as `load_format: "flattened_bucket"` and promise to have finished reading when they reply, so the
buffers are reused across flushes and syncs. Other engines (SGLang) get the usual per-tensor handles,
here views into the buffers, and the buffers are then never reused (torch's IPC reference counting
keeps a buffer alive while an engine still holds it).

Slots start on 64-byte boundaries (aligned copies; whole 64-bit words for the checksums).
"""

from __future__ import annotations

import base64
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_ALIGN_BYTES = 64
_FIRST_BYTES = 1 << 20  # first size of a buffer; it doubles (up to the capacity) as the export needs


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass
class Slot:
    name: str
    offset: int  # elements into the dtype's buffer
    shape: list[int]


@dataclass
class BufferSet:
    """One set of per-dtype flat buffers and what is packed in them."""

    flats: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    used: dict[torch.dtype, int] = field(default_factory=dict)  # bytes, aligned
    slots: dict[torch.dtype, list[Slot]] = field(default_factory=dict)
    pending: Future | None = None  # the post that reads this set

    def empty(self) -> bool:
        return not any(self.slots.values())

    def clear(self) -> None:
        self.used.clear()
        self.slots.clear()

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for dtype, slots in self.slots.items():
            flat = self.flats[dtype]
            for s in slots:
                out.append((s.name, flat[s.offset:s.offset + math.prod(s.shape)].view(s.shape)))
        return out

    def flattened(self) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]]]:
        """(named whole buffers, flattened_bucket_meta) of what is packed."""
        flats, meta = [], []
        for dtype, slots in self.slots.items():
            if not slots:
                continue
            key = f"bucket_{_dtype_name(dtype)}"
            flats.append((key, self.flats[dtype]))
            meta.append({"bucket": key, "dtype": _dtype_name(dtype), "names": [s.name for s in slots],
                         "shapes": [s.shape for s in slots], "offsets": [s.offset for s in slots]})
        return flats, meta


class SharedBucketSender:
    """Packs exported tensors into shared buffers and posts them (see module docstring).

    `post(packed: PackedSend)` is called from the worker thread once per flush and must return only when
    every engine has finished reading. `reuse`: keep and refill the buffers (engines read synchronously);
    else every flush gets new buffers. `checksums`: compute weight checksums of every slot (from the
    buffers the engines read), returned by `finish`."""

    def __init__(self, capacity_bytes: int, device: torch.device, post: Callable[["PackedSend"], None],
                 reuse: bool = True, checksums: bool = False, sets: int = 2,
                 share: Callable[[torch.Tensor], Any] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"shared weight buffer capacity must be positive, got {capacity_bytes} bytes; "
                             "set --update-weight-buffer-size")
        self.capacity, self.device, self.post = capacity_bytes, device, post
        self.reuse, self.checksums = reuse, checksums
        self.share = share  # makes a new buffer shareable now (e.g. moves it into shared memory once)
        self.sets = [BufferSet() for _ in range(max(1, sets))]
        self.current = 0
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-post")
        self.expected: dict[str, list[int]] = {}
        self.flushes = 0

    # --- packing ------------------------------------------------------------------------------
    def add(self, name: str, t: torch.Tensor) -> None:
        """Copy `t` into the current set (flushing it first when its dtype's buffer is full)."""
        nbytes = _aligned(t.numel() * t.element_size())
        s = self.sets[self.current]
        if s.used.get(t.dtype, 0) + nbytes > max(self.capacity, nbytes) and not s.empty():
            self.flush()
            s = self.sets[self.current]
        flat = self._reserve(s, t.dtype, nbytes)
        offset = s.used.get(t.dtype, 0) // t.element_size()
        flat[offset:offset + t.numel()].view(t.shape).copy_(t.detach())
        s.used[t.dtype] = s.used.get(t.dtype, 0) + nbytes
        s.slots.setdefault(t.dtype, []).append(Slot(name, offset, list(t.shape)))

    def _reserve(self, s: BufferSet, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """The set's buffer for `dtype` with room for `nbytes` more; grown (doubling, up to the capacity,
        or to one tensor larger than it) by a new buffer that keeps what is packed."""
        flat = s.flats.get(dtype)
        used = s.used.get(dtype, 0)
        have = 0 if flat is None else flat.numel() * flat.element_size()
        if used + nbytes <= have:
            return flat
        size = max(used + nbytes, min(self.capacity, max(2 * have, _FIRST_BYTES)))
        new = torch.empty(_aligned(size) // dtype.itemsize, dtype=dtype, device=self.device)
        if self.share is not None:
            self.share(new)
        if used:
            new[:used // dtype.itemsize].copy_(flat[:used // dtype.itemsize])
        s.flats[dtype] = new
        return new

    # --- sending --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand the current set to the worker; continue in the next set once its last post is done."""
        s = self.sets[self.current]
        if s.empty():
            return
        from slime.accelerator import get_accelerator

        get_accelerator().synchronize()  # the copies into the buffers are complete before an engine reads
        if self.checksums:  # here, not in the worker: see _send
            from slime.utils.weight_checksum import named_checksums

            self.expected.update(named_checksums(s.named_views()))
        s.pending = self.worker.submit(self._send, s)
        self.flushes += 1
        self.current = (self.current + 1) % len(self.sets)
        nxt = self.sets[self.current]
        if nxt.pending is not None:
            nxt.pending.result()  # raises the post's error, if any
            nxt.pending = None
        if self.reuse:
            nxt.clear()
        else:
            self.sets[self.current] = BufferSet()

    def _send(self, s: BufferSet) -> None:
        # Only pickling and HTTP here, no tensor compute: on CPU a torch op from a second thread starts a second
        # OpenMP thread team in this process, which slowed the trainer's later steps 2x on the quick start.
        self.post(PackedSend(s))

    def finish(self) -> dict[str, list[int]]:
        """Send what is left, wait for every post (raising the first error); returns the checksums."""
        self.flush()
        error = None
        for s in self.sets:
            if s.pending is not None:
                try:
                    s.pending.result()
                except BaseException as e:  # noqa: BLE001 - reported after every post has ended
                    error = error or e
                s.pending = None
            if self.reuse:
                s.clear()
        if not self.reuse:
            self.sets = [BufferSet() for _ in self.sets]
        if error is not None:
            raise error
        expected, self.expected = self.expected, {}
        return expected

    def close(self) -> None:
        """Drop the buffers (after pending posts) and stop the worker."""
        for s in self.sets:
            if s.pending is not None:
                try:
                    s.pending.result()
                except BaseException:  # noqa: BLE001 - closing anyway
                    pass
        self.sets = [BufferSet() for _ in self.sets]
        self.worker.shutdown(wait=True)


class PackedSend:
    """What one flush sends. Serialize a payload once per receiving process: on CPU every serialization
    takes one reference on the shared-memory segment that one opening of the payload gives back."""

    def __init__(self, s: BufferSet) -> None:
        self.set = s

    def names(self) -> list[str]:
        return [slot.name for slots in self.set.slots.values() for slot in slots]

    def nbytes(self) -> int:
        return sum(math.prod(sl.shape) * dt.itemsize for dt, slots in self.set.slots.items() for sl in slots)

    def flattened_payload(self, acc: Any) -> tuple[str, list[dict[str, Any]]]:
        """(base64 handles of the whole buffers, flattened_bucket_meta)."""
        from slime.accelerator.ipc import serialize_named_tensors

        flats, meta = self.set.flattened()
        return base64.b64encode(serialize_named_tensors(acc, flats)).decode(), meta

    def per_tensor_payload(self, acc: Any) -> str:
        """base64 per-tensor handles (views into the buffers), SGLang's plain format."""
        from slime.accelerator.ipc import serialize_named_tensors

        return base64.b64encode(serialize_named_tensors(acc, self.set.named_views())).decode()
