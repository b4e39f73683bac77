"""`load_format: "flattened_bucket"` for /update_weights_from_tensor: many tensors in a few IPC handles.

Sharing one handle per tensor costs one shared-memory segment (CPU) or IPC handle (GPU/NPU) per
weight. A bucket packs all tensors of one dtype into a single 1-D tensor; only the buckets travel
as handles, the layout travels as JSON next to them:

    POST /update_weights_from_tensor
    {"load_format": "flattened_bucket",
     "serialized_named_tensors": [base64(serialize_named_tensors(acc, [("bucket0", flat_bf16), ...]))],
     "flattened_bucket_meta": [
        {"bucket": "bucket0", "dtype": "bfloat16",
         "names":   ["model.embed_tokens.weight", ...],    # HF names, as in the checkpoint
         "shapes":  [[512, 64], ...],
         "offsets": [0, ...]},                              # element offsets into the flat tensor
        ...]}

Weight i of a bucket is `flat[offsets[i] : offsets[i] + prod(shapes[i])].view(shapes[i])`.
The receiver checks every field (bucket present exactly once, dtype equal to the flat tensor's,
ranges inside the flat tensor, names unique across buckets) before any weight changes.
This layout is the embedded engine's; a real SGLang server expects its own bucket layout, so
clients send SGLang servers the plain per-tensor format.

A trainer reuses its flat buffers for every update (slime.backends.megatron.shared_buckets); the last
few received buffers are kept open here, so the next update finds them in torch's cache of opened
shared storages instead of mapping them again (mapping costs a page fault per page on the first read).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from slime.backends.embedded.errors import BadRequest
from slime.backends.embedded.weights import dtype_name


def flatten_named_tensors(
    named: list[tuple[str, torch.Tensor]], bucket_prefix: str = "bucket"
) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]]]:
    """Group `named` by (dtype, device) into flat tensors. Returns (named flat tensors, JSON metadata)."""
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault((t.dtype, t.device), []).append((name, t))
    flats: list[tuple[str, torch.Tensor]] = []
    meta: list[dict[str, Any]] = []
    for i, ((dtype, _), items) in enumerate(groups.items()):
        key = f"{bucket_prefix}{i}"
        offsets, off = [], 0
        for _, t in items:
            offsets.append(off)
            off += t.numel()
        flat = torch.cat([t.detach().reshape(-1) for _, t in items]) if items else torch.empty(0, dtype=dtype)
        flats.append((key, flat))
        meta.append({"bucket": key, "dtype": dtype_name(dtype), "names": [n for n, _ in items],
                     "shapes": [list(t.shape) for _, t in items], "offsets": offsets})
    return flats, meta


KEEP_OPEN = 8  # received buffers kept open (two sets of a few dtypes, from one trainer)
_open: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
_open_lock = threading.Lock()


def keep_open(flats: list[tuple[str, torch.Tensor]]) -> None:
    """Hold the last KEEP_OPEN received buffers (by storage), dropping the least recently used."""
    with _open_lock:
        for _, flat in flats:
            key = (flat.device.type, flat.untyped_storage().data_ptr())
            _open[key] = flat
            _open.move_to_end(key)
        while len(_open) > KEEP_OPEN:
            _open.popitem(last=False)


def drop_open() -> None:
    """Forget the kept buffers (the engine releases its memory)."""
    with _open_lock:
        _open.clear()


def unflatten_buckets(flats: list[tuple[str, torch.Tensor]], meta: Any) -> list[tuple[str, torch.Tensor]]:
    """Views of every named weight inside the received flat tensors. Raises BadRequest on any inconsistency."""
    if not isinstance(meta, list) or not meta:
        raise BadRequest("load_format flattened_bucket needs flattened_bucket_meta: a non-empty list of bucket layouts")
    by_key: dict[str, torch.Tensor] = {}
    for key, flat in flats:
        if key in by_key:
            raise BadRequest(f"flattened bucket {key!r} appears twice in serialized_named_tensors")
        if flat.dim() != 1:
            raise BadRequest(f"flattened bucket {key!r} must be 1-D, got shape {list(flat.shape)}")
        by_key[key] = flat
    out: list[tuple[str, torch.Tensor]] = []
    seen_names: set[str] = set()
    used: set[str] = set()
    for m in meta:
        if not isinstance(m, dict) or not {"bucket", "dtype", "names", "shapes", "offsets"} <= set(m):
            raise BadRequest("each flattened_bucket_meta entry needs bucket, dtype, names, shapes, offsets")
        key = m["bucket"]
        if key not in by_key:
            raise BadRequest(f"flattened_bucket_meta names bucket {key!r}, which is not in serialized_named_tensors")
        if key in used:
            raise BadRequest(f"flattened_bucket_meta describes bucket {key!r} twice")
        used.add(key)
        flat = by_key[key]
        if m["dtype"] != dtype_name(flat.dtype):
            raise BadRequest(f"bucket {key!r} is {dtype_name(flat.dtype)} but its metadata says {m['dtype']}")
        names, shapes, offsets = m["names"], m["shapes"], m["offsets"]
        if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(offsets, list)
                and len(names) == len(shapes) == len(offsets)):
            raise BadRequest(f"bucket {key!r}: names, shapes and offsets must be lists of equal length")
        for name, shape, off in zip(names, shapes, offsets):
            if not isinstance(name, str) or name in seen_names:
                raise BadRequest(f"bucket {key!r}: weight name {name!r} is not a string or appears twice")
            seen_names.add(name)
            if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise BadRequest(f"bucket {key!r}: shape of {name} must be a list of non-negative ints, got {shape!r}")
            numel = math.prod(shape)
            if not isinstance(off, int) or off < 0 or off + numel > flat.numel():
                raise BadRequest(f"bucket {key!r}: {name} at offset {off!r} with {numel} elements overruns the "
                                 f"{flat.numel()}-element bucket")
            out.append((name, flat[off:off + numel].view(shape)))
    unused = sorted(set(by_key) - used)
    if unused:
        raise BadRequest(f"flattened buckets {unused} have no entry in flattened_bucket_meta")
    keep_open(flats)
    return out
