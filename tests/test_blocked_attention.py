"""The reference attention of long sequences in blocks of query rows (slime/accelerator/ops/blocked_attention.py)
against the dense reference path it replaces there, forced on small inputs with blocks of a few rows:
`attention` and `sparse_attention`, outputs and q/k/v grads, float64 within 1e-10 (the issue asks 1e-6) and
float32 within 1e-5, on odd lengths, packed sequences with empty ones, chunks of a sequence (fewer queries than
keys, as context parallel passes them), GQA, causal and not, DSA selections with unused (-1), repeated and
future positions and rows that select nothing. Peak memory of one 8k-token sequence (forward + backward, in a
fresh process each) is below a quarter of the dense path's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slime.accelerator.ops import blocked_attention as blocked
from slime.accelerator.ops import reference as ref


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run(fn, tensors, *args, **kwargs):
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    out = fn(*leaves, *args, **kwargs)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out.detach(), torch.autograd.grad((out * weight).sum(), leaves)


def both_paths(monkeypatch, fn, tensors, *args, **kwargs):
    dense = run(fn, tensors, *args, **kwargs)
    assert blocked.needs_blocks([0, 1], [0, 1], 1) is False
    monkeypatch.setattr(blocked, "SCORE_ELEMENTS_LIMIT", 0)  # every sequence in blocks ...
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 3 * tensors[0].shape[1] * 13)  # ... of about 3 rows
    calls = []
    monkeypatch.setattr(blocked._BlockedAttention, "forward",
                        staticmethod(lambda ctx, *a, f=blocked._BlockedAttention.forward: calls.append(1) or f(ctx, *a)))
    got = run(fn, tensors, *args, **kwargs)
    assert calls, "the blocked path did not run"
    monkeypatch.undo()
    return got, dense


def assert_same(got, dense, dtype):
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    (out, grads), (want, want_grads) = got, dense
    torch.testing.assert_close(out, want, rtol=0, atol=tol)
    for g, w, name in zip(grads, want_grads, "qkv"):
        torch.testing.assert_close(g, w, rtol=0, atol=tol * max(1.0, w.abs().max().item()), msg=name)


CASES = [  # query lengths, key lengths, query heads, key/value heads
    ([13], [13], 3, 3), ([7, 1, 13, 0, 5], [7, 1, 13, 0, 5], 4, 2), ([4, 6], [11, 9], 2, 1), ([9, 9], [9, 9], 2, 2),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lq, lk, hq, hkv", CASES)
def test_attention_equals_the_dense_path(monkeypatch, lq, lk, hq, hkv, causal, dtype):
    g = torch.Generator().manual_seed(sum(lq) + hq)
    q = torch.randn(sum(lq), hq, 6, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, 6, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, 5, generator=g, dtype=dtype)
    assert_same(*both_paths(monkeypatch, ref.attention, (q, k, v), cu(lq), cu(lk), causal=causal, softmax_scale=0.7),
                dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lq, lk, hq, hkv", CASES)
def test_sparse_attention_equals_the_dense_path(monkeypatch, lq, lk, hq, hkv, dtype):
    g = torch.Generator().manual_seed(sum(lk) + hkv)
    q = torch.randn(sum(lq), hq, 6, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, 6, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, 5, generator=g, dtype=dtype)
    top = max(lk) + 2  # -1, repeats and positions past the query (future keys) included
    idx = torch.randint(-1, max(lk), (sum(lq), 5), generator=g).clamp(max=top)
    if sum(lq) > 3:
        idx[2] = -1  # a query that selects nothing: zero output
    got, dense = both_paths(monkeypatch, ref.sparse_attention, (q, k, v), idx.to(torch.int32), cu(lq), cu(lk),
                            softmax_scale=0.4)
    assert_same(got, dense, dtype)
    if sum(lq) > 3:
        assert (got[0][2] == 0).all()


def test_strided_inputs_and_a_broadcast_grad(monkeypatch):
    """MLA passes k and v as slices of one tensor (strided) and `.sum()` hands back an expanded grad."""
    monkeypatch.setattr(blocked, "SCORE_ELEMENTS_LIMIT", 0)
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 40)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(11, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.randn(11, 4, 4, generator=g, dtype=torch.float64).transpose(0, 1).contiguous().transpose(0, 1)
    q.requires_grad_(True)
    k, v = kv.split([4, 3], dim=-1)
    got = ref.attention(q, k, v, cu([11]), cu([11]))
    got_grads = torch.autograd.grad(got.sum(), (q, kv))
    monkeypatch.undo()
    want = ref.attention(q, k, v, cu([11]), cu([11]))
    want_grads = torch.autograd.grad(want.sum(), (q, kv))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bad_selection_is_refused_on_the_blocked_path(monkeypatch):
    monkeypatch.setattr(blocked, "SCORE_ELEMENTS_LIMIT", 0)
    q = torch.randn(5, 1, 4)
    with pytest.raises(ValueError, match="topk_indices"):
        ref.sparse_attention(q, q, q, torch.full((5, 2), -3, dtype=torch.int32), cu([5]), cu([5]))


PEAK_SCRIPT = r"""
import json, torch
from slime.accelerator.ops import blocked_attention, reference
torch.set_num_threads(1)


def status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak():  # Linux >= 4.0: VmHWM back to the current resident size, so a peak left by imports never counts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


n, heads, dim = 8192, 1, 8
cu = torch.tensor([0, n], dtype=torch.int32)
result = {}
for path in ("blocked", "dense"):  # the smaller peak first, so the peak after dense is dense's
    if path == "dense":
        blocked_attention.SCORE_ELEMENTS_LIMIT = 1 << 62
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, generator=g).requires_grad_(True) for _ in range(3))
    reset_peak()
    before = status_kb("VmRSS")
    out = reference.attention(q, k, v, cu, cu)
    out.backward(torch.ones_like(out))
    result[path] = (status_kb("VmHWM") - before) / 1024
    result[path + "_out"] = out.detach()[-4:].tolist()
    del q, k, v, out
print(json.dumps(result))
"""


def test_peak_memory_of_an_8k_sequence_is_below_a_quarter_of_the_dense_path():
    """One 8192-token sequence, one head, float32, forward + backward: the dense path holds [1, 8192, 8192] scores
    (256 MB) several times over; the blocks 4 MB each. Measured in a fresh process as the peak resident size during
    each path (the kernel's peak reset before it) minus the resident size before it."""
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"peak growth: dense {result['dense']:.0f} MB, blocked {result['blocked']:.0f} MB")
    assert result["dense"] > 500  # the dense path really holds the 256 MB score matrix (and its copies)
    assert result["blocked"] < result["dense"] / 4, result
    torch.testing.assert_close(torch.tensor(result["blocked_out"]), torch.tensor(result["dense_out"]), rtol=0, atol=1e-5)
