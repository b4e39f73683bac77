"""torch_npu at call time and what the Ascend op mappings share: the kernel lookup (counted: the probes check
that their inputs reached the kernel), the SoC and torch_npu release of this process, one-time log lines for
inputs a kernel does not take, cumulative offsets in torch_npu's form."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from slime.accelerator.ascend.support import release_key, release_of, soc_of
from slime.accelerator.ops import log_once
from slime.accelerator.ops.reference import seqlens_to_host

LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def has_kernel(name: str) -> bool:
    npu = torch_npu()
    if hasattr(npu, name):
        return True
    try:  # kernels registered only under torch.ops.npu
        getattr(torch.ops.npu, name)
        return True
    except (AttributeError, RuntimeError):
        return False


KERNEL_CALLS: dict[str, int] = {}  # kernel lookups by name; the probes check their inputs reached the kernel


def _kernel(name: str) -> Callable:
    KERNEL_CALLS[name] = KERNEL_CALLS.get(name, 0) + 1
    npu = torch_npu()
    fn = getattr(npu, name, None)
    return fn if fn is not None else getattr(torch.ops.npu, name)


_SOC: list[str] = []  # the process's SoC ("A2", "A3", "950PR", "950DT", ...), set by resolve()


def current_soc() -> str:
    if not _SOC:
        try:
            _SOC.append(soc_of(str(torch.npu.get_device_name())))
        except Exception:
            _SOC.append("unknown")
    return _SOC[0]


def _release() -> str | None:
    return release_of(str(getattr(torch_npu(), "__version__", "")))


def _at_least(release: str) -> bool:
    installed = _release()
    return installed is not None and release_key(installed) >= release_key(release)


def _unsupported(op: str, why: str) -> None:
    log_once(f"ops[npu].{op}: reference for inputs the kernel does not take ({why})")


def _host_offsets(cu: torch.Tensor, total: int, name: str) -> list[int]:
    """torch_npu's cumulative lengths: the end offset of each sequence, without the leading 0."""
    return seqlens_to_host(cu, total, name)[1:]


def _sequence_lengths(offsets: list[int]) -> list[int]:
    """Each sequence's token count from cumulative offsets that start with 0."""
    return [b - a for a, b in zip(offsets, offsets[1:])]
