"""`load_format: "flattened_bucket"` for /update_weights_from_tensor: many tensors in one IPC handle.

Sharing one handle per tensor costs one shared-memory segment (CPU) or IPC handle (GPU/NPU) per
weight. SGLang's FlattenedTensorBucket packs the bytes of every tensor into one 1-D uint8 tensor; each
entry of `serialized_named_tensors` (one per engine TP rank) is then base64 of the pickled dict
`{"flattened_tensor": <uint8 tensor>, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx,
end_idx, numel), ...]}` (slime.utils.tensor_bucket). This engine opens it with the allow-list unpickler
(the metadata record is its only non-tensor global) and checks every entry before any weight changes.

A trainer reuses its flat buffers for every update (slime.backends.megatron.weight_sync.shared_buckets); the last
few received buffers are kept open here, so the next update finds them in torch's cache of opened
shared storages instead of mapping them again (mapping costs a page fault per page on the first read).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from slime.backends.embedded.errors import BadRequest
from slime.utils.tensor_bucket import BadBucket, FlattenedTensorMetadata, reconstruct

_ALIGN = 64


def pack(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """SGLang's layout of `named` in a new uint8 tensor (slots 64-byte aligned, so every dtype view is)."""
    meta, off = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, off, off + nbytes, nbytes))
        off += -(-nbytes // _ALIGN) * _ALIGN
    flat = torch.zeros(off, dtype=torch.uint8, device=named[0][1].device if named else "cpu")
    for (_, t), m in zip(named, meta):
        flat[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t.detach())
    return flat, meta


KEEP_OPEN = 8  # received buffers kept open (two sets, from a few trainers)
_open: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
_open_lock = threading.Lock()


def keep_open(flat: torch.Tensor) -> None:
    """Hold the last KEEP_OPEN received buffers (by storage), dropping the least recently used."""
    with _open_lock:
        key = (flat.device.type, flat.untyped_storage().data_ptr())
        _open[key] = flat
        _open.move_to_end(key)
        while len(_open) > KEEP_OPEN:
            _open.popitem(last=False)


def drop_open() -> None:
    """Forget the kept buffers (the engine releases its memory)."""
    with _open_lock:
        _open.clear()


def unflatten(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Views of every named weight inside a received bucket. Raises BadRequest on any inconsistency."""
    try:
        named = reconstruct(flat, metadata)
    except BadBucket as e:
        raise BadRequest(f"flattened bucket refused: {e}") from None
    keep_open(flat)
    return named
