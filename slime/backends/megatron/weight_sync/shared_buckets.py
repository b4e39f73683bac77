"""Colocated weight sync through reused shared buffers: each exported byte is copied once on the sender.

The export yields full HF tensors (often views of the trainer's parameters); `SharedBucketSender.add`
copies each one straight into its slot of a flat uint8 buffer (every dtype in one, SGLang's
FlattenedTensorBucket layout, slime.utils.tensor_bucket) that is shared with the engines once (an IPC
handle / shared-memory segment per buffer, not per tensor). When a buffer is full, the packed set is
posted to every engine (`load_format: "flattened_bucket"`) from a worker thread while the export fills
the other set (double buffering); a set is written again only after every engine has answered the post
that read it.

Engines that advertise `"flattened_bucket": true` in `/get_model_info` (the embedded engine) promise to
have finished reading when they reply, so the buffers are reused across flushes and syncs; so does every
engine on a synchronized device (CPU), where a reply follows the engine's completed copies. Other engines
(SGLang on a GPU/NPU, whose copies may still be queued on its stream when it replies) get new buffers for
every flush (torch's IPC reference counting keeps a buffer alive while an engine still holds it).

Transposed views (the GLM export's expert weights) are copied as runs: an expert's gate and up views form
one [2I, H] transpose of its [H, 2I] weight, copied in one `copy_transposed` (cache-sized tiles, on the host
split over this thread and one worker thread).

Slots start on 64-byte boundaries (aligned copies and dtype views; whole 64-bit words for the checksums).
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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass
class Slot:
    name: str
    start: int  # bytes into the set's buffer
    shape: list[int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class BufferSet:
    """One flat uint8 buffer and what is packed in it."""

    flat: torch.Tensor | None = None
    used: int = 0  # bytes, aligned
    slots: list[Slot] = field(default_factory=list)
    pending: Future | None = None  # the post that reads this set

    def empty(self) -> bool:
        return not self.slots

    def clear(self) -> None:
        self.used = 0
        self.slots = []

    def view(self, s: Slot) -> torch.Tensor:
        return self.flat[s.start:s.start + s.nbytes].view(s.dtype).view(s.shape)

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, self.view(s)) for s in self.slots]

    def metadata(self) -> list:
        """SGLang's FlattenedTensorMetadata of every slot (byte ranges into the uint8 buffer)."""
        from slime.utils.tensor_bucket import FlattenedTensorMetadata

        return [FlattenedTensorMetadata(s.name, torch.Size(s.shape), s.dtype, s.start, s.start + s.nbytes, s.nbytes)
                for s in self.slots]


class SharedBucketSender:
    """Packs exported tensors into shared buffers and posts them (see module docstring).

    `post(packed: PackedSend)` is called from the worker thread once per flush, in order, and must return
    only when every engine has finished reading. `reuse`: keep and refill the buffers (engines read synchronously);
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
        # The first failed post. Packing and flushing go on after it (the flushes of every trainer rank that
        # feeds engines must stay in step); finish() raises it.
        self.error: BaseException | None = None
        self._pending: _TransposedRun | None = None  # transposed views packed but not yet copied (see add)

    # --- packing ------------------------------------------------------------------------------
    def add(self, name: str, t: torch.Tensor) -> None:
        """Copy `t` into the current set (flushing it first when the buffer is full)."""
        nbytes = _aligned(t.numel() * t.element_size())
        s = self.sets[self.current]
        if s.used + nbytes > max(self.capacity, nbytes) and not s.empty():
            self.flush()
            s = self.sets[self.current]
        if s.used + nbytes > (0 if s.flat is None else s.flat.numel()):
            self._copy_pending()  # growing the buffer copies what is in it: every slot written first
        self._reserve(s, nbytes)
        slot = Slot(name, s.used, list(t.shape), t.dtype)
        t = t.detach()
        if not self._extends_pending(s, slot, t):
            self._copy_pending()
            if _transposed(t):
                self._pending = _TransposedRun(s, slot.start, t)
            else:
                s.view(slot).copy_(t)
        s.used += nbytes
        s.slots.append(slot)

    def _extends_pending(self, s: BufferSet, slot: Slot, t: torch.Tensor) -> bool:
        run = self._pending
        if run is None or run.set is not s or not run.continued_by(t, slot.start):
            return False
        run.count += 1
        return True

    def _copy_pending(self) -> None:
        if self._pending is not None:
            run, self._pending = self._pending, None
            run.copy()

    def _reserve(self, s: BufferSet, nbytes: int) -> None:
        """Room for `nbytes` more in the set's buffer; grown (doubling, up to the capacity, or to one tensor
        larger than it) by a new buffer that keeps what is packed."""
        have = 0 if s.flat is None else s.flat.numel()
        if s.used + nbytes <= have:
            return
        size = _aligned(max(s.used + nbytes, min(self.capacity, max(2 * have, _FIRST_BYTES))))
        new = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self.share is not None:
            self.share(new)
        if s.used:
            new[:s.used].copy_(s.flat[:s.used])
        s.flat = new

    # --- sending --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand the current set to the worker; continue in the next set once its last post is done."""
        self._copy_pending()
        s = self.sets[self.current]
        if s.empty():
            return
        from slime.accelerator import get_accelerator

        get_accelerator().synchronize()  # the copies into the buffers are complete before an engine reads
        if self.checksums:  # here, not in the worker: see _send
            from slime.utils.weight_checksum import named_checksums

            self.expected.update(named_checksums(s.named_views()))
        s.pending = self.worker.submit(self._send, s, self.flushes)
        self.flushes += 1
        self.current = (self.current + 1) % len(self.sets)
        nxt = self.sets[self.current]
        if nxt.pending is not None:
            try:
                nxt.pending.result()
            except BaseException as e:  # noqa: BLE001 - kept; later flushes still happen, finish() raises it
                self.error = self.error or e
            nxt.pending = None
        if self.reuse:
            nxt.clear()
        else:
            self.sets[self.current] = BufferSet()

    def _send(self, s: BufferSet, index: int) -> None:
        # Only pickling and HTTP here, no tensor compute: on CPU a torch op from a second thread starts a second
        # OpenMP thread team in this process, which slowed the trainer's later steps 2x on the quick start.
        self.post(PackedSend(s, index))

    def finish(self) -> dict[str, list[int]]:
        """Send what is left, wait for every post (raising the first error); returns the checksums."""
        self.flush()
        error, self.error = self.error, None
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
        self._pending = None
        self.sets = [BufferSet() for _ in self.sets]
        self.worker.shutdown(wait=True)


def _transposed(t: torch.Tensor) -> bool:
    """A 2-D column-major view (an exported expert weight: `w[:, a:b].t()` of megatron's [in, out] layout)."""
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) == 1 and t.stride(1) >= t.shape[0]


class _TransposedRun:
    """Consecutive transposed views that are one transposed matrix together, bound for adjacent slots.

    The GLM export yields an expert's gate and up weights as `w[:, :I].t()` and `w[:, I:].t()` of its
    [H, 2I] weight: each alone is a transpose with a row stride of 2I, which torch copies element by element
    with strided reads (~0.5 GB/s here). Copied as the one [2I, H] transpose they form, in cache-sized tiles
    (copy_transposed), they copy 4x faster; a down weight ([H, I] of a contiguous [I, H]) is such a
    transpose alone."""

    def __init__(self, s: BufferSet, start: int, first: torch.Tensor) -> None:
        self.set, self.start, self.first, self.count = s, start, first, 1

    def continued_by(self, t: torch.Tensor, start: int) -> bool:
        f, n = self.first, self.count
        rows, isz = f.shape[0], f.element_size()
        return (t.dtype == f.dtype and t.shape == f.shape and t.stride() == f.stride()
                and t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                and t.storage_offset() == f.storage_offset() + n * rows
                and start == self.start + n * f.numel() * isz)

    def copy(self) -> None:
        f = self.first
        rows, cols = f.shape[0] * self.count, f.shape[1]
        src = f.as_strided((rows, cols), f.stride())
        nbytes = rows * cols * f.element_size()
        copy_transposed(self.set.flat[self.start:self.start + nbytes].view(f.dtype).view(rows, cols), src)


# Tiles of a host transpose (copy_transposed): 512 x 64 elements (64 KiB of bfloat16). A tile's source
# columns (64 rows of the stored matrix) stay in L1 while its rows are written, and at 32768 elements a
# tile is at or below torch's intra-op grain size, so each tile's copy runs on its calling thread alone
# (no OpenMP region from the worker thread below). Measured on the 2-core CPU, bfloat16 [2048, 1024] /
# [512, 2048] expert weights: torch's own blocked transpose (copy_ of a whole transposed matrix, one
# thread) 0.9-1.1 GB/s, these tiles 1.2-1.3 GB/s on one thread, 2.0-2.3 GB/s on two.
_TILE_ROWS, _TILE_COLS = 512, 64
_MIN_TILED = 1 << 16  # elements; smaller transposes are one copy_
_transpose_worker: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    global _transpose_worker
    if _transpose_worker is None:
        _transpose_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-transpose")
    return _transpose_worker


def copy_transposed(dst: torch.Tensor, src: torch.Tensor, threads: int | None = None) -> None:
    """`dst.copy_(src)` for a contiguous 2-D `dst` and a 2-D `src` of the same shape and dtype whose rows
    are strided (a transposed view, e.g. an exported expert weight), bit for bit. On the host the copy is
    split into cache-sized tiles, and the tile rows into two halves copied at once by this thread and one
    worker thread when torch may use more than one thread (`threads`: torch.get_num_threads() unless
    given); elsewhere (a device kernel) and for small matrices it is one `copy_`."""
    # `is_cpu`: the tensor's own storage is host memory (any accelerator's host staging buffers too), where
    # this thread's tile loop is the copy; device memory gets the device's kernel
    if (dst.dim() != 2 or not dst.is_cpu or src.device != dst.device or src.dtype != dst.dtype
            or src.shape != dst.shape or not dst.is_contiguous() or dst.numel() < _MIN_TILED):
        dst.copy_(src)
        return
    rows, cols = dst.shape
    threads = torch.get_num_threads() if threads is None else threads

    def copy_rows(lo: int, hi: int) -> None:
        for r in range(lo, hi, _TILE_ROWS):
            e = min(r + _TILE_ROWS, hi)
            d, s = dst[r:e], src[r:e]
            for c in range(0, cols, _TILE_COLS):
                d[:, c:c + _TILE_COLS].copy_(s[:, c:c + _TILE_COLS])

    if threads < 2 or rows < 2:
        copy_rows(0, rows)
        return
    mid = rows // 2
    other = _worker().submit(copy_rows, mid, rows)
    try:
        copy_rows(0, mid)
    finally:
        other.result()


def pack_into(flat: torch.Tensor, items: list[tuple[int, torch.Tensor]]) -> None:
    """Copy each (byte offset, tensor) into the uint8 buffer `flat`, transposed views coalesced as `add` does."""
    holder, run = BufferSet(flat=flat), None
    for start, t in items:
        t = t.detach()
        if run is not None and run.continued_by(t, start):
            run.count += 1
            continue
        if run is not None:
            run.copy()
            run = None
        if _transposed(t):
            run = _TransposedRun(holder, start, t)
        else:
            flat[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
    if run is not None:
        run.copy()


class PackedSend:
    """What one flush sends. Serialize a payload once per receiving process: on CPU every serialization
    takes one reference on the shared-memory segment that one opening of the payload gives back."""

    def __init__(self, s: BufferSet, index: int = 0) -> None:
        self.set, self.index = s, index  # index: the flush's number in this sender

    def names(self) -> list[str]:
        return [slot.name for slot in self.set.slots]

    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.set.slots)

    def flattened_payload(self, acc: Any) -> str:
        """One engine TP rank's `serialized_named_tensors` entry: base64 of SGLang's flattened_bucket dict,
        the buffer travelling as this process's IPC handle."""
        from slime.accelerator.ipc import serialize_flattened_bucket

        return base64.b64encode(serialize_flattened_bucket(acc, self.set.flat[:self.set.used],
                                                           self.set.metadata())).decode()
