"""SIMULATED npu_rms_norm, npu_rotary_mul, npu_swiglu: documented contracts, float64 math."""

from __future__ import annotations

import torch

from ._common import check, check_contiguous, defect, doc, f64, require_soc

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _documented(op: str, key: str, fallback: tuple) -> tuple:
    names = doc(op).get(key)
    return tuple(_DTYPES[n] for n in names if n in _DTYPES) if names else fallback


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """-> (y in self.dtype, rstd float32). gamma's shape must equal the trailing dims of self."""
    op = "npu_rms_norm"
    require_soc(op)
    check(2 <= self.dim() <= 8, op, f"self must have 2..8 dims (1-D input is refused), got {self.dim()}")
    check(self.dtype in _documented(op, "dtypes", tuple(_DTYPES.values())), op, f"unsupported dtype {self.dtype}")
    # Docstring (every wheel read): gamma's dtype must be self's.
    check(gamma.dtype == self.dtype or not doc(op).get("gamma_dtype_equals_self", True), op,
          f"gamma dtype {gamma.dtype} must equal self dtype {self.dtype}")
    n = gamma.dim()
    check(n <= self.dim() and tuple(self.shape[self.dim() - n:]) == tuple(gamma.shape), op,
          f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of self {tuple(self.shape)}")
    dims = tuple(range(self.dim() - n, self.dim()))
    x = f64(self)
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x * rstd * f64(gamma)).to(self.dtype)
    return y, rstd.detach().to(torch.float32)


# r1/r2 shapes the docstring allows per input layout: for "half" 11SD/B1SD/BNSD, 1S1D/BS1D/BSND, S11D/SB1D/SBND
# (BNSD, BSND, SBND input); for "interleave" only 11SD, 1S1D, S11D. Per input dim: 1 = broadcast, else = x's.
_R1_PATTERNS = {
    "half": ("11SD", "B1SD", "BNSD", "1S1D", "BS1D", "BSND", "S11D", "SB1D", "SBND"),
    "interleave": ("11SD", "1S1D", "S11D"),
}
_LAYOUT_OF = {"11SD": "BNSD", "B1SD": "BNSD", "BNSD": "BNSD", "1S1D": "BSND", "BS1D": "BSND", "BSND": "BSND",
              "S11D": "SBND", "SB1D": "SBND", "SBND": "SBND"}


def _r1_fits(pattern: str, x_shape, r_shape) -> bool:
    return all((r == 1) if p == "1" else (r == x) for p, x, r in zip(pattern, x_shape, r_shape))


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode="half", rotate=None):
    """x * r1 + rotate(x) * r2 over the whole last dim; r1/r2 at full width D.
    "half": rotate(x) = cat(-x2, x1); "interleave": pairs (2i, 2i+1) -> (-x_{2i+1}, x_{2i}).
    Docstring (every wheel read): input 4-D (BNSD/BSND/SBND), r1/r2 per layout as in _R1_PATTERNS."""
    op = "npu_rotary_mul"
    require_soc(op)
    mode = rotary_mode
    check(mode in ("half", "interleave"), op, f"rotary_mode must be 'half' or 'interleave', got {mode!r}")
    check(rotate is None, op, "rotate is not simulated")
    dims = doc(op).get("input_dims") or [4]
    check(self.dim() in dims, op, f"input must be {'/'.join(map(str, dims))}-D (BNSD, BSND or SBND), got {self.dim()}-D")
    check(r1.dim() == self.dim() and r2.dim() == self.dim(), op, "r1/r2 must have the same number of dims as input")
    check(r1.shape == r2.shape, op, "r1 and r2 must have the same shape")
    d = self.shape[-1]
    d_max = doc(op).get("d_max_exclusive") or 896
    check(d % 2 == 0 and d < d_max, op, f"D must be even and < {d_max}, got {d}")
    check(r1.shape[-1] == d, op, f"r1/r2 last dim must be D={d} (full width), got {r1.shape[-1]}")
    check(r1.dtype == self.dtype and r2.dtype == self.dtype, op, "r1/r2 must have the input's dtype")
    fits = [p for p in _R1_PATTERNS[mode] if _r1_fits(p, self.shape, r1.shape)]
    check(bool(fits), op, f"rotary_mode={mode!r}: r1 {tuple(r1.shape)} fits none of {'/'.join(_R1_PATTERNS[mode])} "
                          f"for input {tuple(self.shape)}")
    if mode == "interleave":
        layout = _LAYOUT_OF[fits[0]]
        b, n = (self.shape[0], self.shape[1]) if layout == "BNSD" else \
            (self.shape[0], self.shape[2]) if layout == "BSND" else (self.shape[1], self.shape[2])
        limit = doc(op).get("interleave_bn_max_exclusive") or 1000
        check(b * n < limit, op, f"interleave needs B * N < {limit}, got {b} * {n}")
    x, c, s = f64(self), f64(r1), f64(r2)
    if mode == "half" or defect("npu_rotary_mul:interleave_as_half"):
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
