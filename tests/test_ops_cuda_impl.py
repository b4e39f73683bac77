"""The CUDA op implementations (slime/accelerator/ops/cuda.py) use only torch APIs, so their glue is
checked here on CPU tensors against the float64 reference (SDPA path; torch._grouped_mm where this
torch has it). On a CUDA machine the `accel` tests in test_ops.py run them on the GPU."""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.ops import cuda as C
from slime.accelerator.ops import reference as R

from test_ops import ATTN_TOL, TOL, assert_close, cu, grads, random_topk, ref_leaf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,hq,hkv,causal", [
    ([5, 1, 0, 12], [5, 1, 0, 12], 8, 2, True),
    ([3, 2, 1], [5, 2, 4], 4, 4, True),  # more keys than queries: bottom-right alignment
    ([4, 3], [2, 3], 4, 1, True),  # more queries than keys: rows without keys give 0
    ([4, 3], [6, 1], 4, 2, False),
])
def test_sdpa_attention(dtype, lq, lk, hq, hkv, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), hq, 24, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(sum(lk), hkv, 24, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(sum(lk), hkv, 16, generator=g).to(dtype).requires_grad_(True)
    out = C.attention(q, k, v, cu(lq, "cpu"), cu(lk, "cpu"), causal=causal)
    qr, kr, vr = ref_leaf(q), ref_leaf(k), ref_leaf(v)
    want = R.attention(qr, kr, vr, cu(lq, "cpu"), cu(lk, "cpu"), causal=causal)
    assert_close(out, want, ATTN_TOL[dtype], "sdpa attention")
    up = torch.randn(out.shape, generator=g)
    for name, a, b in zip("qkv", grads(out, (q, k, v), up.to(dtype)), grads(want, (qr, kr, vr), up.double())):
        assert_close(a, b, ATTN_TOL[dtype], f"sdpa attention d{name}")


def test_sdpa_sparse_attention():
    g = torch.Generator().manual_seed(1)
    lens = [6, 1, 0, 7]
    q, k = (torch.randn(14, 4, 24, generator=g).requires_grad_(True) for _ in range(2))
    v = torch.randn(14, 4, 16, generator=g).requires_grad_(True)
    idx = random_topk(lens, 5, g)
    idx[3, :] = -1
    idx[3, 0] = 5  # only a future key: the row sees nothing and gives 0
    out = C.sparse_attention(q, k, v, idx, cu(lens, "cpu"), cu(lens, "cpu"))
    qr, kr, vr = ref_leaf(q), ref_leaf(k), ref_leaf(v)
    want = R.sparse_attention(qr, kr, vr, idx, cu(lens, "cpu"), cu(lens, "cpu"))
    assert (out[3] == 0).all()
    assert_close(out, want, ATTN_TOL[torch.float32], "sdpa sparse attention")
    up = torch.randn(out.shape, generator=g)
    for name, a, b in zip("qkv", grads(out, (q, k, v), up), grads(want, (qr, kr, vr), up.double())):
        assert_close(a, b, ATTN_TOL[torch.float32], f"sdpa sparse attention d{name}")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path(dtype):
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(4, 16, 8, generator=g).to(dtype).requires_grad_(True)
    y = C.grouped_matmul(x, w, counts)
    assert y.grad_fn is not None and "ContiguousGrad" in type(y.grad_fn).__name__, "the _grouped_mm path did not run"
    xr, wr = ref_leaf(x), ref_leaf(w)
    want = torch.einsum("tk,tkn->tn", xr, wr[torch.repeat_interleave(torch.arange(4), counts)])
    assert_close(y, want, TOL[dtype], "grouped_mm forward")
    dx, dw = torch.autograd.grad(y.sum(), (x, w))  # .sum() gives a broadcast gradient
    dxr, dwr = torch.autograd.grad(want.sum(), (xr, wr))
    assert_close(dx, dxr, TOL[dtype], "grouped_mm dx")
    assert_close(dw, dwr, TOL[dtype] * 2, "grouped_mm dw")
    assert (dw[1] == 0).all()


def test_cuda_provider_sources(monkeypatch):
    monkeypatch.setattr(C, "_FLASH", [None])
    assert C.resolve("attention", None).source == "torch.nn.functional.scaled_dot_product_attention"
    monkeypatch.setattr(C, "_FLASH", [lambda *a, **k: None])
    assert C.resolve("attention", None).source == "flash_attn.flash_attn_varlen_func"
    assert C.resolve("rms_norm", None) is None  # stays on the reference until measured faster
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    missing = C.resolve("grouped_matmul", None)
    assert missing.fn is None and "_grouped_mm" in missing.unavailable
