"""A safetensors file checked from its header alone (the preflight of --hf-checkpoint, the embedded engine's
/update_weights_from_disk): a truncated or foreign file is one line naming it, before any tensor is read."""

from __future__ import annotations

import json
import math
import os
import struct


class SafetensorsHeaderError(ValueError):
    """One line: the file, what is wrong, the fix."""


# Bytes per element of the safetensors dtypes.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER_BYTES = 100 << 20


def check(path: str, flag: str = "--hf-checkpoint") -> int:
    """Validate a safetensors file from its header alone; returns the number of tensors."""
    name = f"{flag} shard {path}"
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsHeaderError(f"{name} is truncated ({size} bytes, no header); re-copy or re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise SafetensorsHeaderError(f"{name}: header length {n} exceeds the file ({size} bytes): truncated or not "
                                     "safetensors; re-copy or re-download it")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsHeaderError(f"{name}: unreadable header ({e}); re-copy or re-download it") from e
    data = size - 8 - n
    end_max = 0
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            itemsize = _DTYPE_BYTES[meta["dtype"]]
            numel = math.prod(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsHeaderError(f"{name}: tensor {tensor} has a malformed header entry ({e!r}); re-export it") from e
        if end - begin != numel * itemsize:
            raise SafetensorsHeaderError(f"{name}: tensor {tensor} spans {end - begin} bytes but {meta['dtype']}{meta['shape']} "
                                 f"needs {numel * itemsize}; re-export it")
        end_max = max(end_max, end)
    if end_max > data:
        raise SafetensorsHeaderError(f"{name} is truncated: its tensors need {end_max} data bytes, the file holds {data}; "
                             "re-copy or re-download it")
    return len(header) - ("__metadata__" in header)
