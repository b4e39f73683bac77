"""CUDA kernels of the KDA ops (contracts: slime/accelerator/ops/kda.py), part of the "cuda" op provider.

kda: fla-core's `chunk_kda` (PyPI fla-core, an optional dependency) over the packed tokens as one [1, T, ...] batch
with `cu_seqlens` (its varlen mode: the state restarts at every sequence), q/k L2-normalised in the kernel.
causal_conv1d: fla-core's varlen `causal_conv1d`, else Dao-AILab's causal-conv1d (`causal_conv1d_fn` with per-token
sequence ids, which needs the channel-last layout a transposed [T, C] tensor has). kda_gate stays on the reference
(fla fuses the gate into chunk_kda only together with its own cumsum). Where neither package imports, the table
serves the reference and logs why once. float64 and CPU tensors always take the reference.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from slime.accelerator.ops import DeviceOp
from slime.accelerator.ops import kda as kda_reference

OPS = ("kda", "causal_conv1d")
KERNEL_PATHS = {  # name -> (module, attribute)
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "fla_conv": ("fla.modules.convolution", "causal_conv1d"),
    "dao_conv": ("causal_conv1d", "causal_conv1d_fn"),
}
_KERNELS: dict[str, Any] = {}


def kernel(name: str) -> Callable | None:
    """The kernel function `name` of KERNEL_PATHS, or None where its package does not import (probed once)."""
    if name not in _KERNELS:
        module, attribute = KERNEL_PATHS[name]
        try:
            _KERNELS[name] = getattr(importlib.import_module(module), attribute)
        except Exception:
            _KERNELS[name] = None
    return _KERNELS[name]


def _on_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and x.shape[0] > 0


def fla_chunk_kda(chunk_kda: Callable, q, k, v, g, beta, cu_seqlens, scale=None) -> torch.Tensor:
    """The op's packed [T, H, D] call as fla's varlen batch of one."""
    kda_reference.check_kda_shapes(q, k, v, g, beta)
    out, _ = chunk_kda(q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None], scale=scale,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.long))
    return out[0].to(v.dtype)


def kda(q, k, v, g, beta, cu_seqlens, scale=None) -> torch.Tensor:
    chunk_kda = kernel("chunk_kda")
    if chunk_kda is None or not _on_kernel(q):
        return kda_reference.kda(q, k, v, g, beta, cu_seqlens, scale)
    return fla_chunk_kda(chunk_kda, q, k, v, g, beta, cu_seqlens, scale)


def conv_with_kernels(fla_conv: Callable | None, dao_conv: Callable | None, x, weight, cu_seqlens, activation):
    """x [T, C], weight [C, K] through fla's varlen convolution, else causal-conv1d's with sequence ids."""
    weight = weight.to(x.dtype)
    if fla_conv is not None:
        out = fla_conv(x=x[None], weight=weight, activation=activation, cu_seqlens=cu_seqlens.to(torch.long))
        return (out[0] if isinstance(out, tuple) else out)[0]
    lengths = cu_seqlens.diff().to(torch.long)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=x.device, dtype=torch.int32), lengths)
    return dao_conv(x.t()[None], weight, None, seq_idx=seq_idx[None], activation=activation)[0].t()


def causal_conv1d(x, weight, cu_seqlens, activation="silu") -> torch.Tensor:
    fla_conv, dao_conv = kernel("fla_conv"), kernel("dao_conv")
    if (fla_conv is None and dao_conv is None) or not _on_kernel(x) or activation not in kda_reference.ACTIVATIONS:
        return kda_reference.causal_conv1d(x, weight, cu_seqlens, activation)
    return conv_with_kernels(fla_conv, dao_conv, x, weight, cu_seqlens, activation)


def resolve(op_name: str) -> DeviceOp | None:
    if op_name == "kda":
        if kernel("chunk_kda") is None:
            return DeviceOp(None, "", "fla-core is not installed (pip install fla-core for fla.ops.kda.chunk_kda)")
        return DeviceOp(kda, "fla.ops.kda.chunk_kda")
    if op_name == "causal_conv1d":
        if kernel("fla_conv") is not None:
            return DeviceOp(causal_conv1d, "fla.modules.convolution.causal_conv1d")
        if kernel("dao_conv") is not None:
            return DeviceOp(causal_conv1d, "causal_conv1d.causal_conv1d_fn")
        return DeviceOp(None, "", "neither fla-core nor causal-conv1d is installed (pip install fla-core)")
    return None
