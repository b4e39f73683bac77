"""A SIMULATED `sgl_kernel_npu` for tests (not hardware, not the sgl-project package): the two kernels slime maps
GLM-5.3-Flash's KDA ops to, following their contracts as sgl-kernel-npu's sources state them (tag 20260821):

- `torch.ops.npu.causal_conv1d` (csrc/pytorch_extensions.cpp schema; csrc/causal_conv1d/op_host checks):
  x [T, dim] (with query_start_loc) or [B, S, dim], bfloat16/float16, contiguous; weight [width, dim] in x's
  dtype, width 2..4; conv_states [lines, width-1, dim] in x's dtype, updated in place with each sequence's last
  width-1 inputs; activation_mode 1 = SiLU. Registered only by builds with SGL_KERNEL_ENABLE_A3_ONLY_OPS, which
  the package's CMakeLists turns off for Ascend950*: on a simulated 950 the call raises.
- `sgl_kernel_npu.fla.kda_gate.fused_kda_gate_npu` (python/sgl_kernel_npu/sgl_kernel_npu/fla/kda_gate.py).

Both are forward only (no autograd), as the real ones. The math is float64 torch, independent of slime's
reference. Importing registers the op once per process under torch.ops.npu (torch.library, CPU)."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

__version__ = "2026.8.21"
SIMULATED = True
_OP = "causal_conv1d"
SCHEMA = ("causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor? bias=None, Tensor? query_start_loc=None, "
          "Tensor? cache_indices=None, Tensor? has_initial_state=None, Tensor? num_accepted_tokens=None, "
          "int activation_mode=0, int pad_slot_id=-1, int run_mode=0) -> Tensor")


def _fail(message: str) -> RuntimeError:
    return RuntimeError(f"npu::causal_conv1d: {message} [simulated sgl_kernel_npu]")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise _fail(message)


def _simulated_soc() -> str:
    return importlib.import_module("torch_npu").current_soc()


def causal_conv1d_impl(x, weight, conv_states, bias=None, query_start_loc=None, cache_indices=None,
                       has_initial_state=None, num_accepted_tokens=None, activation_mode=0, pad_slot_id=-1,
                       run_mode=0):
    _check(not _simulated_soc().startswith("950"), "not registered: sgl-kernel-npu's Ascend950 build leaves out "
                                                   "its A3-only ops (SGL_KERNEL_ENABLE_A3_ONLY_OPS off)")
    _check(x.dim() in (2, 3), "x must be 2D or 3D tensor")
    _check(weight.dim() == 2, "weight must be 2D tensor")
    _check(x.dtype in (torch.bfloat16, torch.float16), "Only BF16 and FP16 are supported")
    _check(weight.dtype == x.dtype, "weight dtype must match x dtype")
    _check(conv_states.dtype == x.dtype, "conv_states dtype must match x dtype")
    _check(x.is_contiguous() and weight.is_contiguous() and conv_states.is_contiguous(), "inputs must be contiguous")
    width, dim = weight.shape
    _check(2 <= width <= 4, "Only support width in [2,4]")
    _check(x.shape[-1] == dim, f"weight must be [width, dim] with dim = x's last dim {x.shape[-1]}, got {tuple(weight.shape)}")
    _check(run_mode == 0 and num_accepted_tokens is None, "only the prefill mode (run_mode 0) is simulated")
    _check(activation_mode in (0, 1), f"activation_mode must be 0 or 1, got {activation_mode}")
    if x.dim() == 3:
        _check(False, "only the varlen [T, dim] input is simulated")
    _check(query_start_loc is not None and query_start_loc.numel() >= 2, "query_start_loc must have at least 2 elements")
    starts = [int(v) for v in query_start_loc.tolist()]
    _check(starts[0] == 0 and starts[-1] == x.shape[0] and all(a <= b for a, b in zip(starts, starts[1:])),
           f"query_start_loc must be cumulative offsets from 0 to T={x.shape[0]}, got {starts}")
    _check(conv_states.dim() == 3 and conv_states.shape[1:] == (width - 1, dim),
           f"conv_states must be [lines, width-1={width - 1}, dim={dim}], got {tuple(conv_states.shape)}")
    lines = cache_indices.tolist() if cache_indices is not None else list(range(len(starts) - 1))
    initial = has_initial_state.tolist() if has_initial_state is not None else [False] * (len(starts) - 1)
    w = weight.to(torch.float64).t().unsqueeze(1)  # [dim, 1, width] for a depthwise conv1d
    out = torch.empty_like(x)
    for b, (s, e) in enumerate(zip(starts, starts[1:])):
        line = int(lines[b])
        if line == pad_slot_id or e == s:  # a padded slot, or an empty sequence: nothing to convolve
            continue
        history = conv_states[line].to(torch.float64) if initial[b] else x.new_zeros(width - 1, dim, dtype=torch.float64)
        seq = torch.cat([history, x[s:e].to(torch.float64)])  # [width-1 + len, dim]
        y = F.conv1d(seq.t().unsqueeze(0), w, bias=None if bias is None else bias.to(torch.float64), groups=dim)[0].t()
        out[s:e] = (F.silu(y) if activation_mode == 1 else y).to(x.dtype)
        conv_states[line].copy_(seq[-(width - 1):].to(x.dtype))
    return out


def _register() -> object | None:
    try:
        torch.ops.npu.causal_conv1d  # noqa: B018 - registered already (this module imported under another name)
        return None
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901 - a test double of a C++ extension's op
    lib.define(SCHEMA)
    lib.impl(_OP, causal_conv1d_impl, "CPU")
    return lib


_LIBRARY = _register()
