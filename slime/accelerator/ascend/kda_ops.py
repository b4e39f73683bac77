"""Ascend mappings of GLM-5.3-Flash's KDA ops (contracts: slime/accelerator/ops/kda.py), part of the "npu" provider.

What exists, read from primary sources (no NPU here; checked against tests/npu_sim, not hardware):
- kda_gate: sgl-kernel-npu's `sgl_kernel_npu.fla.kda_gate.fused_kda_gate_npu` (a triton-ascend kernel, in the
  package from tag 2026.8.10; SGLang 0.5.23's Ascend KDA backend calls it). Forward only: the gradient is the
  reference's autograd on a recompute (the gate is elementwise, so the recompute is cheap).
- causal_conv1d: sgl-kernel-npu's `torch.ops.npu.causal_conv1d` (csrc/causal_conv1d, from tag 2026.03.31.rc2):
  bfloat16/float16 x [T, C] with query_start_loc, weight [K, C] in x's dtype (K 2..4), a conv_states cache
  [sequences, K-1, C] it updates in place, activation_mode 1 = SiLU. It is registered only when the package is
  built with SGL_KERNEL_ENABLE_A3_ONLY_OPS, which its CMakeLists turns off for Ascend950* SoCs: Atlas A2/A3
  only. Forward only: the gradient is the reference's autograd on a recompute. torch_npu's own
  npu_masked_causal_conv1d / npu_fused_causal_conv1d (torch_npu 2.14.0, Ascend 950) take kernel width 3 only;
  GLM-5.3-Flash's is 4, so on a 950 the reference runs.
- kda: no published kernel. SGLang 0.5.23 calls `torch.ops.npu.chunk_kda_fwd` (forward, inference), but neither
  torch_npu (<= 2.14.0) nor sgl-kernel-npu (tag 20260821) defines it, so its contract cannot be checked: the
  chunked reference runs on every SoC, and the op table says so.
Each mapping is probed once per process against the float64 reference (probes.py), as the torch_npu ones.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from slime.accelerator.ops import DeviceOp, log_once
from slime.accelerator.ops import kda as kda_reference

OPS = ("kda", "causal_conv1d", "kda_gate")
LOW_PRECISION = (torch.float16, torch.bfloat16)
_CONV_WIDTHS = (2, 3, 4)  # csrc/causal_conv1d/op_host/causal_conv1d.cpp: "Only support width in [2,4]"


@dataclass(frozen=True)
class SglKernelMapping:
    op: str
    kernel: str  # what runs, as the op table reports it
    since: str  # first sgl-kernel-npu tag that has it
    socs: tuple[str, ...]  # SoCs it is built for (empty: every SoC sgl-kernel-npu builds for)
    backward: str


MAPPINGS: dict[str, SglKernelMapping] = {
    m.op: m
    for m in (
        SglKernelMapping("kda_gate", "sgl_kernel_npu.fla.kda_gate.fused_kda_gate_npu", "2026.8.10", (),
                         "reference autograd on a recompute (the kernel is forward only)"),
        SglKernelMapping("causal_conv1d", "torch.ops.npu.causal_conv1d (sgl-kernel-npu)", "2026.03.31.rc2",
                         ("A2", "A3"), "reference autograd on a recompute (the kernel is forward only)"),
    )
}
NO_KERNEL = {
    "kda": "no published NPU kernel: SGLang 0.5.23 calls torch.ops.npu.chunk_kda_fwd (forward only), which neither "
           "torch_npu <= 2.14.0 nor sgl-kernel-npu 20260821 defines; the chunked reference runs",
}


def _version_key(version: str) -> tuple[int, ...]:
    """'2026.8.10' / '2026.03.31.rc2' / '20260821' -> a comparable key (a release candidate before its release)."""
    parts = version.replace("-", ".").split(".")
    if len(parts) == 1 and len(parts[0]) == 8 and parts[0].isdigit():
        parts = [parts[0][:4], parts[0][4:6], parts[0][6:]]
    nums = [int(p) for p in parts[:3] if p.isdigit()]
    rc = next((int(p[2:] or 0) for p in parts[3:] if p.startswith("rc")), None)
    return (*nums, 0 if rc is not None else 1, rc or 0)


def installed_version() -> str | None:
    from importlib import metadata

    for name in ("sgl_kernel_npu", "sgl-kernel-npu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    module = importlib.import_module("sgl_kernel_npu")  # a source build without metadata
    return getattr(module, "__version__", None)


def _fused_kda_gate() -> Callable:
    return importlib.import_module("sgl_kernel_npu.fla.kda_gate").fused_kda_gate_npu


def _conv_kernel() -> Callable:
    importlib.import_module("sgl_kernel_npu")  # loads libsgl_kernel_npu.so, which registers torch.ops.npu.*
    return torch.ops.npu.causal_conv1d


KERNELS: dict[str, Callable[[], Callable]] = {"kda_gate": _fused_kda_gate, "causal_conv1d": _conv_kernel}
KERNEL_CALLS: dict[str, int] = {}  # by op; the probes check their inputs reached the kernel


def _kernel(op: str) -> Callable:
    KERNEL_CALLS[op] = KERNEL_CALLS.get(op, 0) + 1
    return KERNELS[op]()


class _ForwardKernel(torch.autograd.Function):
    """out = kernel(*inputs) forward; the backward recomputes the reference in torch and differentiates it."""

    @staticmethod
    def forward(ctx, kernel_fn, reference_fn, *inputs):
        ctx.reference_fn = reference_fn
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in inputs])
        ctx.others = [None if torch.is_tensor(t) else t for t in inputs]
        with torch.no_grad():
            return kernel_fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        inputs = [s if o is None else o for s, o in zip(saved, ctx.others)]
        leaves = [t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t for t in inputs]
        wanted = [t for t, need in zip(leaves, ctx.needs_input_grad[2:]) if need]
        with torch.enable_grad():
            out = ctx.reference_fn(*leaves)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *[next(grads) if need else None for need in ctx.needs_input_grad[2:]])


def _with_reference_backward(kernel_fn, reference_fn, *inputs):
    if torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in inputs):
        return _ForwardKernel.apply(kernel_fn, reference_fn, *inputs)
    return kernel_fn(*inputs)


# --- kda_gate ----------------------------------------------------------------------------------

def _gate_on_kernel(f, A_log, dt_bias, lower_bound):  # noqa: N803 (the checkpoint's name)
    heads, dim = f.shape[-2:]
    # The kernel reads [tokens, H*D] rows and a flat [H*D] bias and computes in float32 (its output dtype).
    out = _kernel("kda_gate")(f.reshape(-1, heads * dim).contiguous(), A_log.float().contiguous(), dim,
                              gate_bias=dt_bias.reshape(-1).float().contiguous(), lower_bound=lower_bound)
    return out.view(f.shape)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,  # noqa: N803
             lower_bound: float | None) -> torch.Tensor:
    if f.dim() < 2 or f.numel() == 0 or f.dtype == torch.float64:
        return kda_reference.kda_gate(f, A_log, dt_bias, lower_bound)
    return _with_reference_backward(_gate_on_kernel, kda_reference.kda_gate, f, A_log, dt_bias, lower_bound)


# --- causal_conv1d -----------------------------------------------------------------------------

def _conv_on_kernel(x, weight, cu_seqlens, activation):
    sequences = cu_seqlens.numel() - 1
    width = weight.shape[1]
    # Training starts every sequence from zero history: a zero cache line per sequence, none marked initial.
    states = x.new_zeros(sequences, width - 1, x.shape[1])
    return _kernel("causal_conv1d")(
        x.contiguous(), weight.t().to(x.dtype).contiguous(), states,
        query_start_loc=cu_seqlens.to(device=x.device, dtype=torch.int64),
        cache_indices=torch.arange(sequences, device=x.device, dtype=torch.int64),
        has_initial_state=torch.zeros(sequences, device=x.device, dtype=torch.bool),
        activation_mode=0 if activation is None else 1, pad_slot_id=-1, run_mode=0,
    )


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                  activation: str | None = "silu") -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in LOW_PRECISION or x.shape[0] == 0 \
            or weight.shape[1] not in _CONV_WIDTHS or activation not in kda_reference.ACTIVATIONS:
        if x.dtype != torch.float64 and x.dim() == 2 and weight.dim() == 2 and weight.shape[1] not in _CONV_WIDTHS:
            log_once(f"ops[npu].causal_conv1d: reference for kernel width {weight.shape[1]} (the kernel takes "
                     f"{_CONV_WIDTHS})")
        return kda_reference.causal_conv1d(x, weight, cu_seqlens, activation)
    return _with_reference_backward(_conv_on_kernel, kda_reference.causal_conv1d, x, weight, cu_seqlens, activation)


IMPLEMENTATIONS: dict[str, Callable] = {"kda_gate": kda_gate, "causal_conv1d": causal_conv1d}


def resolve(op_name: str, soc: str, probe: Callable[[str, Callable, str], str]) -> DeviceOp:
    """The Ascend implementation of a KDA op, or why not: sgl-kernel-npu imports, its version has the kernel,
    the SoC is one it is built for, and the one-time probe (probe(op, fn, kernel) -> '' or why) passes."""
    if op_name in NO_KERNEL:
        return DeviceOp(None, "", NO_KERNEL[op_name])
    mapping = MAPPINGS[op_name]
    need = f"sgl-kernel-npu >= {mapping.since}"
    if mapping.socs and soc not in mapping.socs:
        return DeviceOp(None, "", f"{mapping.kernel} is built for {'/'.join(mapping.socs)} only (sgl-kernel-npu's "
                                  f"A3-only ops are left out of its Ascend950 build), not {soc}")
    try:
        version = installed_version()
        KERNELS[op_name]()
    except Exception as e:
        return DeviceOp(None, "", f"{mapping.kernel} unavailable ({type(e).__name__}: {e}); needs {need}, built "
                                  f"from source for this SoC (it is not on PyPI)")
    if version is not None and _version_key(version) < _version_key(mapping.since):
        return DeviceOp(None, "", f"sgl-kernel-npu {version} lacks {mapping.kernel}; needs {need}")
    why = probe(op_name, IMPLEMENTATIONS[op_name], op_name)
    if why:
        return DeviceOp(None, "", f"probe of {mapping.kernel} on {soc} failed: {why}")
    return DeviceOp(IMPLEMENTATIONS[op_name], mapping.kernel + " (forward; backward: reference)")
