"""SIMULATED npu_rms_norm, npu_rotary_mul, npu_swiglu: documented contracts, float64 math."""

from __future__ import annotations

import torch

from ._common import at_least, check, check_contiguous, f64, fail, require_soc

_RMS_DTYPES = {(d, d) for d in (torch.float16, torch.bfloat16, torch.float32)} | {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32)}


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """-> (y in self.dtype, rstd float32). gamma's shape must equal the trailing dims of self."""
    op = "npu_rms_norm"
    require_soc(op)
    check(2 <= self.dim() <= 8, op, f"self must have 2..8 dims (1-D input is refused), got {self.dim()}")
    check((self.dtype, gamma.dtype) in _RMS_DTYPES, op, f"unsupported dtype pair self={self.dtype}, gamma={gamma.dtype}")
    n = gamma.dim()
    check(n <= self.dim() and tuple(self.shape[self.dim() - n:]) == tuple(gamma.shape), op,
          f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of self {tuple(self.shape)}")
    dims = tuple(range(self.dim() - n, self.dim()))
    x = f64(self)
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x * rstd * f64(gamma)).to(self.dtype)
    return y, rstd.detach().to(torch.float32)


_UNSET = object()


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode=_UNSET, rotate=None):
    """x * r1 + rotate(x) * r2 over the whole last dim; r1/r2 at full width D.
    "half": rotate(x) = cat(-x2, x1); "interleave": pairs (2i, 2i+1) -> (-x_{2i+1}, x_{2i})."""
    op = "npu_rotary_mul"
    require_soc(op)
    if rotary_mode is not _UNSET and not at_least("7.0.0"):
        raise TypeError("npu_rotary_mul() got an unexpected keyword argument 'rotary_mode'")
    mode = "half" if rotary_mode is _UNSET else rotary_mode
    check(mode in ("half", "interleave"), op, f"rotary_mode must be 'half' or 'interleave', got {mode!r}")
    check(rotate is None, op, "rotate is not simulated")
    check(self.dim() in (3, 4), op, f"input must be 3-D or 4-D, got {self.dim()}-D")
    check(r1.dim() == self.dim() and r2.dim() == self.dim(), op, "r1/r2 must have the same number of dims as input")
    check(r1.shape == r2.shape, op, "r1 and r2 must have the same shape")
    d = self.shape[-1]
    check(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    check(r1.shape[-1] == d, op, f"r1/r2 last dim must be D={d} (full width), got {r1.shape[-1]}")
    check(r1.dtype == self.dtype and r2.dtype == self.dtype, op, "r1/r2 must have the input's dtype")
    if self.dim() == 3:  # TND: r1 is T1D (or TND for "half")
        ok = r1.shape[0] == self.shape[0] and (r1.shape[1] == 1 or (mode == "half" and r1.shape[1] == self.shape[1]))
        check(ok, op, f"for TND input {tuple(self.shape)} r1 must be T1D, got {tuple(r1.shape)}")
    else:
        try:
            torch.broadcast_shapes(r1.shape, self.shape)
        except RuntimeError:
            raise fail(op, f"r1 {tuple(r1.shape)} does not broadcast to input {tuple(self.shape)}") from None
    x, c, s = f64(self), f64(r1), f64(r2)
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * c + rot * s).to(self.dtype)


def npu_swiglu(self: torch.Tensor, dim: int = -1):
    """silu(first half along dim) * second half."""
    op = "npu_swiglu"
    check_contiguous(op, input=self)
    check(self.numel() > 0, op, "empty tensors are not supported")
    check(self.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"unsupported dtype {self.dtype}")
    check(-self.dim() <= dim < self.dim(), op, f"dim {dim} out of range")
    check(self.shape[dim] % 2 == 0, op, f"size {self.shape[dim]} along dim {dim} must be even")
    a, b = f64(self).chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(self.dtype)
