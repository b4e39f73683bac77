"""Ascend mappings of the dense per-token ops: RMSNorm and SwiGLU (npu_rms_norm, npu_swiglu) and rotary
embeddings (npu_rotary_mul). Each calls the reference for inputs its kernel does not take."""

from __future__ import annotations

import torch

from slime.accelerator.ascend.kernels import FLOATS, _kernel
from slime.accelerator.ops import reference
from slime.accelerator.ops.reference import check_rotary_dim, rotary_pair_angles

# --- norm / activation ----------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    # The kernel refuses 1-D input (x needs a leading dim besides gamma's).
    if weight is None or x.dim() < 2 or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    # The docstring requires gamma's dtype = x's: mixed pairs (bf16 x, fp32 weight) run in the promoted
    # dtype, which is also the reference's output dtype.
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if dtype not in FLOATS:
        return reference.rms_norm(x, weight, eps)
    y, _rstd = _kernel("npu_rms_norm")(x.to(dtype), weight.to(dtype), epsilon=float(eps))
    return y


def swiglu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in FLOATS or x.numel() == 0 or x.shape[-1] % 2:
        return reference.swiglu(x)
    return _kernel("npu_swiglu")(x.contiguous(), dim=-1)


# --- rotary ---------------------------------------------------------------------------------

# Rotary modes whose kernel path is on: "interleave" needs rotary_mode (7.0.0+); each mode's probe must pass.
_ROTARY_MODES: dict[str, bool] = {"half": True, "interleave": True}
_ROTARY_MODE_KW = [True]  # the kernel has the rotary_mode argument (7.0.0+); set by _prepare
_ROTARY_HEADS_LIMIT = 1000  # docstring: B, N < 1000 ("half"), B * N < 1000 ("interleave"); here B = 1


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> torch.Tensor:
    rd = check_rotary_dim(x, rotary_dim)
    mode = "interleave" if interleaved else "half"
    if x.dim() != 3 or rd >= 896 or x.dtype not in FLOATS or x.shape[0] == 0 or x.shape[1] >= _ROTARY_HEADS_LIMIT \
            or not _ROTARY_MODES[mode]:
        return reference.apply_rotary(x, cos, sin, rotary_dim, interleaved)
    c, s = rotary_pair_angles(x, cos, sin, rd)
    if c.dim() != 3 or c.shape[0] != x.shape[0] or c.shape[1] != 1:  # one angle row per token
        return reference.apply_rotary(x, cos, sin, rotary_dim, interleaved)
    # The kernel takes 4-D input only (every wheel's docstring): [T, H, D] goes in as BSND [1, T, H, D] with
    # cos/sin as 1S1D [1, T, 1, D], the one r1 layout both modes take for BSND. It rotates the whole last
    # dim and takes cos/sin at full width: "half" pairs (i, i+d/2) share an angle -> cat(c, c);
    # "interleave" pairs (2i, 2i+1) -> each angle repeated twice.
    widen = (lambda a: a.repeat_interleave(2, dim=-1)) if interleaved else (lambda a: torch.cat((a, a), dim=-1))
    r1 = widen(c.detach()).to(x.dtype).unsqueeze(0).contiguous()
    r2 = widen(s.detach()).to(x.dtype).unsqueeze(0).contiguous()
    xr = x[..., :rd].unsqueeze(0).contiguous()
    kernel = _kernel("npu_rotary_mul")
    out = (kernel(xr, r1, r2, rotary_mode=mode) if _ROTARY_MODE_KW[0] else kernel(xr, r1, r2)).squeeze(0)
    return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)
