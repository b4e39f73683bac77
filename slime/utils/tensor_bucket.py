"""SGLang's flattened tensor bucket (`load_format: "flattened_bucket"`), as its weight-sync code defines it.

One payload per engine TP rank is the dict `{"flattened_tensor": <1-D uint8 tensor>, "metadata": [meta, ...]}`
where each `meta` is a `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel)`: weight `name` is the bytes `flattened_tensor[start_idx:end_idx]` viewed as
`dtype` and reshaped to `shape` (SGLang >= 0.5.5 packs every dtype into one uint8 tensor; `numel` counts
those bytes). Older SGLang packed one dtype per bucket with element indices; `reconstruct` accepts that
layout too (the flat tensor then has the weights' dtype).

`FlattenedTensorMetadata` here is this project's own record with SGLang's field names; it pickles under
SGLang's global name (slime.accelerator.ipc), so a payload built here decodes with SGLang's unpickler and
one built by SGLang's classes decodes here, without importing SGLang on either side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# The global name SGLang's unpickler allows for the metadata records (sglang/srt/utils/common.py SafeUnpickler).
SGLANG_METADATA_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class BadBucket(ValueError):
    """A flattened bucket whose metadata does not describe its tensor."""


def reconstruct(flat: Any, metadata: Any) -> list[tuple[str, torch.Tensor]]:
    """Views of every weight inside `flat`, checked in full first (names unique, ranges inside the tensor,
    sizes equal to shape x dtype, offsets aligned for the dtype). Raises BadBucket naming the first problem."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise BadBucket("flattened_tensor must be a 1-D tensor")
    if not isinstance(metadata, list) or not metadata:
        raise BadBucket("metadata must be a non-empty list of FlattenedTensorMetadata")
    multi = flat.dtype == torch.uint8  # SGLang >= 0.5.5: bytes of any dtype
    out, seen = [], set()
    for m in metadata:
        if not isinstance(m, FlattenedTensorMetadata):
            raise BadBucket(f"metadata entries must be FlattenedTensorMetadata, got {type(m).__name__}")
        if not isinstance(m.name, str) or m.name in seen:
            raise BadBucket(f"weight name {m.name!r} is not a string or appears twice")
        seen.add(m.name)
        if not isinstance(m.dtype, torch.dtype):
            raise BadBucket(f"{m.name}: dtype {m.dtype!r} is not a torch dtype")
        try:
            shape = [int(s) for s in m.shape]
        except (TypeError, ValueError):
            raise BadBucket(f"{m.name}: shape {m.shape!r} is not a list of ints") from None
        if any(s < 0 for s in shape) or not all(isinstance(v, int) for v in (m.start_idx, m.end_idx, m.numel)):
            raise BadBucket(f"{m.name}: negative dimension or non-integer start_idx/end_idx/numel")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
            raise BadBucket(f"{m.name}: range [{m.start_idx}, {m.end_idx}) with numel {m.numel} is not inside the "
                            f"{flat.numel()}-element flattened tensor")
        want = math.prod(shape) * (m.dtype.itemsize if multi else 1)
        if not multi and m.dtype != flat.dtype:
            raise BadBucket(f"{m.name}: dtype {m.dtype} in a {flat.dtype} bucket (one-dtype buckets hold one dtype)")
        if m.numel != want:
            raise BadBucket(f"{m.name}: {m.numel} {'bytes' if multi else 'elements'} for shape {shape} of {m.dtype} "
                            f"(needs {want})")
        if multi and (flat.storage_offset() + m.start_idx) % m.dtype.itemsize:
            raise BadBucket(f"{m.name}: byte offset {m.start_idx} is not aligned for {m.dtype}")
        part = flat[m.start_idx:m.end_idx]
        out.append((m.name, (part.view(m.dtype) if multi else part).view(shape)))
    return out
