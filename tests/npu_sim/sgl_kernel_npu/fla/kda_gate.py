"""SIMULATED sgl_kernel_npu.fla.kda_gate (tests only, not the sgl-project package): fused_kda_gate_npu with the
signature and checks of python/sgl_kernel_npu/sgl_kernel_npu/fla/kda_gate.py (tag 20260821): gate [..., H*D] rows,
A_log [H], gate_bias [H*D]; y = lower_bound * sigmoid(exp(A_log) (gate + bias)) with a lower bound, else
-exp(A_log) softplus(gate + bias) (softplus(z) = z above `threshold`); float32 [..., H, D]. Forward only."""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.nn.functional as F


def fused_kda_gate_npu(gate: torch.Tensor, A_log: torch.Tensor, head_dim: int, *,  # noqa: N803
                       gate_bias: Optional[torch.Tensor] = None, beta: float = 1.0, threshold: float = 20.0,
                       lower_bound: Optional[float] = None) -> torch.Tensor:
    importlib.import_module("torch_npu")  # the triton-ascend kernel runs on the NPU torch_npu drives
    original_shape = gate.shape[:-1]
    gate_2d = gate.reshape(-1, gate.shape[-1])
    hidden = gate_2d.shape[1]
    heads = A_log.numel()
    if heads * head_dim != hidden:
        raise ValueError("KDA gate shape does not match A_log and head_dim")
    if gate_bias is not None and gate_bias.numel() != hidden:
        raise ValueError("KDA gate bias shape does not match the gate")
    if not gate_2d.is_contiguous():
        raise ValueError("KDA gate rows must be contiguous (the kernel reads [T, H*D] rows) [simulated]")
    z = gate_2d.to(torch.float64)
    if gate_bias is not None:
        z = z + gate_bias.reshape(1, -1).to(torch.float64)
    rate = A_log.to(torch.float64).exp().repeat_interleave(head_dim).view(1, -1)
    if lower_bound is not None:
        y = lower_bound * torch.sigmoid(rate * z)
    else:
        y = -rate * F.softplus(z, beta=beta, threshold=threshold)
    return y.to(torch.float32).view(*original_shape, heads, head_dim)
