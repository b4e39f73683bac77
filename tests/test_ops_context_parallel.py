"""The attention op contracts under context parallel: a CP rank's queries (its two chunks of every sequence, as
query segments) against key segments that run from each sequence's start to the chunk's end
(slime_plugins/models/common/context_parallel.py) give exactly the rows of the full computation, on every
accelerator this run has (cpu, simulated NPU) and in the CUDA module's SDPA path (CPU tensors).

- attention / sparse_attention: forward = the full float64 reference's rows of this rank (float64: 1e-12;
  device dtypes: test_ops' ATTN_TOL); the grads of q, k, v summed over the CP ranks = the full grads
  (what the all-gather / reduce-scatter of the model's key gather relies on).
- lightning_indexer: the top-k of every query equals the full run's (float64 and float32), key positions
  counted from the sequence start, with sequences longer than 2 x topk so keys are dropped.
"""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.ops import cuda as C
from slime.accelerator.ops import reference as R
from slime_plugins.models.common.context_parallel import build_layout
from test_ops import (ATTN_TOL, assert_close, assert_kernel, cu, grads, indexer_scores, kernel_calls,  # noqa: F401
                      leaf, random_topk)

LENS = [8, 16, 4]  # multiples of 2 * CP for CP = 2: chunk lengths 2, 4 and 1


def local_inputs(layout, q, k, v):
    return (q.index_select(0, layout.local_index.to(q.device)), k.index_select(0, layout.kv_index.to(k.device)),
            v.index_select(0, layout.kv_index.to(v.device)))


def check_against_full(run, q, k, v, full_out, full_grads, up, tol, cp=2):
    """run(q_local, k_segments, v_segments, layout) per CP rank; forward rows and summed grads vs the full run."""
    got = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for rank in range(cp):
        layout = build_layout(cu(LENS, "cpu"), cp, rank)
        qd, kd, vd = (leaf(t, t.dtype, t.device) for t in (q, k, v))
        out = run(*local_inputs(layout, qd, kd, vd), layout)
        rows = layout.local_index
        assert_close(out, full_out[rows], tol, f"rank {rank} forward")
        for acc_grad, g in zip(got, grads(out, (qd, kd, vd), up[rows].to(out))):
            acc_grad += g.double().cpu()
    for name, a, b in zip("qkv", got, full_grads):
        assert_close(a, b, tol, f"d{name} summed over CP ranks")


def qkv(dtype, dev, seed, h=4, dqk=24, dv=16, hkv=None):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return [torch.randn(t, n, d, generator=g).to(dev, dtype) for n, d in ((h, dqk), (hkv or h, dqk), (hkv or h, dv))], g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_local_queries_against_prefix_keys(accel, kernel_calls, dtype):
    if dtype == torch.float64 and accel.name != "cpu":
        pytest.skip("float64 is the reference's own check")
    (q, k, v), g = qkv(dtype, accel.device(), 21, hkv=2)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    full = R.attention(qr, kr, vr, cu(LENS, "cpu"), cu(LENS, "cpu"))
    up = torch.randn(full.shape, generator=g, dtype=torch.float64)
    full_grads = grads(full, (qr, kr, vr), up)
    tol = 1e-12 if dtype == torch.float64 else ATTN_TOL[dtype]

    def run(ql, ks, vs, layout):
        dev = ql.device
        return accel.ops.attention(ql, ks, vs, layout.cu_seqlens_q.to(dev), layout.cu_seqlens_kv.to(dev))

    check_against_full(run, q, k, v, full, full_grads, up, tol)
    if dtype != torch.float64:
        assert_kernel(kernel_calls, "npu_fusion_attention")


def test_sparse_attention_local_queries_against_prefix_keys(accel, kernel_calls):
    (q, k, v), g = qkv(torch.float32, accel.device(), 22)
    idx = random_topk(LENS, 5, g)  # positions within each sequence
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    full = R.sparse_attention(qr, kr, vr, idx, cu(LENS, "cpu"), cu(LENS, "cpu"))
    up = torch.randn(full.shape, generator=g, dtype=torch.float64)
    full_grads = grads(full, (qr, kr, vr), up)

    def run(ql, ks, vs, layout):
        dev = ql.device
        local_idx = idx.index_select(0, layout.local_index).to(dev)  # still positions within the sequence
        return accel.ops.sparse_attention(ql, ks, vs, local_idx, layout.cu_seqlens_q.to(dev),
                                          layout.cu_seqlens_kv.to(dev))

    check_against_full(run, q, k, v, full, full_grads, up, ATTN_TOL[torch.float32])
    assert_kernel(kernel_calls, "npu_fusion_attention")


@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_sdpa_path_local_queries(sparse):
    (q, k, v), g = qkv(torch.float32, "cpu", 23)
    idx = random_topk(LENS, 5, g)
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    if sparse:
        full = R.sparse_attention(qr, kr, vr, idx, cu(LENS, "cpu"), cu(LENS, "cpu"))
    else:
        full = R.attention(qr, kr, vr, cu(LENS, "cpu"), cu(LENS, "cpu"))
    up = torch.randn(full.shape, generator=g, dtype=torch.float64)
    full_grads = grads(full, (qr, kr, vr), up)

    def run(ql, ks, vs, layout):
        if sparse:
            return C.sparse_attention(ql, ks, vs, idx.index_select(0, layout.local_index), layout.cu_seqlens_q,
                                      layout.cu_seqlens_kv)
        return C.attention(ql, ks, vs, layout.cu_seqlens_q, layout.cu_seqlens_kv)

    check_against_full(run, q, k, v, full, full_grads, up, ATTN_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lightning_indexer_local_queries_select_the_full_runs_keys(accel, kernel_calls, dtype):
    if dtype != torch.bfloat16 and accel.name != "cpu":
        pytest.skip("the Ascend indexer takes bfloat16")
    g = torch.Generator().manual_seed(24)
    dev, h, d, topk = accel.device(), 4, 128, 3  # sequences of 8 and 16 > 2 x topk: keys are dropped
    t = sum(LENS)
    q = torch.randn(t, h, d, generator=g).to(dev, dtype)
    k = torch.randn(t, d, generator=g).to(dev, dtype)
    w = (torch.randn(t, h, generator=g) * h**-0.5).to(dev, dtype)
    full = accel.ops.lightning_indexer(q, k, w, cu(LENS, dev), cu(LENS, dev), topk, softmax_scale=0.125).cpu()
    assert (full >= 0).sum() < sum(min(i + 1, t) for s in LENS for i in range(s))  # some keys dropped
    for rank in range(2):
        layout = build_layout(cu(LENS, "cpu"), 2, rank)
        rows, keys = layout.local_index.to(dev), layout.kv_index.to(dev)
        local = accel.ops.lightning_indexer(q.index_select(0, rows), k.index_select(0, keys), w.index_select(0, rows),
                                            layout.cu_seqlens_q.to(dev), layout.cu_seqlens_kv.to(dev), topk,
                                            softmax_scale=0.125).cpu()
        want = full.index_select(0, layout.local_index)
        if accel.name == "cpu" or getattr(accel, "simulated", False):
            if accel.ops.source("lightning_indexer") == "reference":
                assert torch.equal(local, want), f"rank {rank}: top-k differs from the full run"
            else:  # the kernel's own order among the selected keys
                assert torch.equal(local.sort(-1).values, want.sort(-1).values), f"rank {rank}: selected keys differ"
        else:  # a real device's kernels may round differently per shape: only near-ties may swap
            near_ties_only(local, want, layout, indexer_scores(q.cpu(), k.cpu(), w.cpu(), LENS, 0.125))
    if dtype == torch.bfloat16:
        assert_kernel(kernel_calls, "npu_lightning_indexer")


def near_ties_only(local: torch.Tensor, want: torch.Tensor, layout, scores: list[torch.Tensor]) -> None:
    starts = torch.tensor(LENS).cumsum(0) - torch.tensor(LENS)
    for row, got_keys, want_keys in zip(layout.local_index.tolist(), local.tolist(), want.tolist()):
        b = int((starts <= row).nonzero().max())
        got_set, want_set = {j for j in got_keys if j >= 0}, {j for j in want_keys if j >= 0}
        if got_set != want_set:
            sc = scores[b][row - int(starts[b])]
            gap = sc[sorted(want_set - got_set)].min() - sc[sorted(got_set - want_set)].max()
            assert abs(float(gap)) <= 1e-2 * float(sc[sc.isfinite()].abs().max()), f"row {row}: {got_keys} vs {want_keys}"


def test_layout_balances_chunks_and_covers_every_token():
    for cp in (1, 2, 4):
        lens = [8 * cp, 4 * cp, 0, 2 * cp]
        seen = []
        for rank in range(cp):
            layout = build_layout(cu(lens, "cpu"), cp, rank)
            q_lens = layout.cu_seqlens_q.diff().tolist()
            kv_lens = layout.cu_seqlens_kv.diff().tolist()
            assert sum(q_lens) == sum(lens) // cp  # equal shares
            # the two chunks of a sequence: r and 2CP-1-r, so every rank attends over the same number of keys
            assert sum(kv_lens) == sum(n // (2 * cp) * (2 * cp + 1) for n in lens)
            seen += layout.local_index.tolist()
            assert torch.equal(layout.gather_order[torch.cat([build_layout(cu(lens, "cpu"), cp, r).local_index
                                                              for r in range(cp)])], torch.arange(sum(lens)))
        assert sorted(seen) == list(range(sum(lens)))
    with pytest.raises(ValueError, match="multiple of 2\\*CP=4"):
        build_layout(cu([6], "cpu"), 2, 0)


def test_npu_attention_over_1k_segments_runs_in_kernel_slices(kernel_calls, accel):
    """Context parallel doubles a pack's segments; npu_fusion_attention TND takes at most 1K per call, so the
    Ascend mapping slices the pack (each slice in the kernel) instead of falling back to the reference."""
    if not getattr(accel, "simulated", False):
        pytest.skip("the Ascend mapping's slicing (simulated NPU)")
    g = torch.Generator().manual_seed(25)
    lens_q, lens_k = [1, 2] * 550, [3, 2] * 550  # 1100 query segments, each the end of its key segment
    q = torch.randn(sum(lens_q), 2, 8, generator=g).to(accel.device())
    k = torch.randn(sum(lens_k), 2, 8, generator=g).to(accel.device())
    v = torch.randn(sum(lens_k), 2, 8, generator=g).to(accel.device())
    dev = accel.device()
    attention = accel.ops.attention  # (the table's probes call the kernel once)
    before = kernel_calls.get("npu_fusion_attention", 0)
    out = attention(q, k, v, cu(lens_q, dev), cu(lens_k, dev))
    want = R.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), cu(lens_q, "cpu"), cu(lens_k, "cpu"))
    assert_close(out, want, ATTN_TOL[torch.float32], "sliced attention")
    assert kernel_calls["npu_fusion_attention"] - before == 2
