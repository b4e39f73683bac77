"""CUDA op implementations (provider for the "cuda" accelerator). Filled in per op; until then the
reference runs."""

from __future__ import annotations

from slime.accelerator.ops import DeviceOp


def resolve(op_name: str, acc) -> DeviceOp | None:
    return None
