"""Every op, forward and backward, on every accelerator this run has (cpu, simulated NPU, real devices),
against the float64 reference.

Tolerances (max |error| / max(1, max |expected|)): float32 2e-5 (attention-like 1e-4), bfloat16 3e-2
(attention-like 5e-2). On the simulated NPU every test also asserts that the torch_npu kernel ran
(no silent fallback to the reference).
"""

from __future__ import annotations

import math

import pytest
import torch

from slime.accelerator.ops import reference as R

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def leaf(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype).requires_grad_(True)


def ref_leaf(t: torch.Tensor) -> torch.Tensor:
    """float64 copy of the (already rounded) device input."""
    return t.detach().double().cpu().requires_grad_(True)


def cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


@pytest.fixture
def kernel_calls(accel, monkeypatch):
    """{torch_npu function: calls} on the simulated NPU, so tests can assert the kernel path ran."""
    calls: dict[str, int] = {}
    if not getattr(accel, "simulated", False):
        return None
    import torch_npu

    for name in [n for n in dir(torch_npu) if n.startswith("npu_")]:
        fn = getattr(torch_npu, name)

        def counted(*a, __fn=fn, __name=name, **kw):
            calls[__name] = calls.get(__name, 0) + 1
            return __fn(*a, **kw)

        monkeypatch.setattr(torch_npu, name, counted)
    return calls


def assert_kernel(calls, name: str) -> None:
    if calls is not None:
        assert calls.get(name, 0) > 0, f"{name} was not called: the op fell back to the reference"


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream, allow_unused=True)


# --- rms_norm / swiglu ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rms_norm(accel, kernel_calls, dtype, fp32_weight):
    g = torch.Generator().manual_seed(1)
    dev = accel.device()
    x = leaf(torch.randn(7, 3, 64, generator=g) * 3, dtype, dev)
    w = leaf(torch.rand(64, generator=g) + 0.5, torch.float32 if fp32_weight else dtype, dev)
    y = accel.ops.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.promote_types(dtype, w.dtype)
    xr, wr = ref_leaf(x), ref_leaf(w)
    yr = R.rms_norm(xr, wr, 1e-5)
    assert_close(y, yr, TOL[dtype], "rms_norm forward")
    up = torch.randn(y.shape, generator=g)
    dx, dw = grads(y, (x, w), up.to(dev, y.dtype))
    dxr, dwr = grads(yr, (xr, wr), up.double())
    assert_close(dx, dxr, TOL[dtype], "rms_norm dx")
    assert_close(dw, dwr, TOL[dtype] * 4, "rms_norm dweight (sums 21 rows)")
    assert_kernel(kernel_calls, "npu_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_gate_first(accel, kernel_calls, dtype):
    g = torch.Generator().manual_seed(2)
    x = leaf(torch.randn(9, 2, 2 * 24, generator=g), dtype, accel.device())
    y = accel.ops.swiglu(x)
    xr = ref_leaf(x)
    expected = torch.nn.functional.silu(xr[..., :24]) * xr[..., 24:]  # gate is the first half
    assert_close(y, expected, TOL[dtype], "swiglu forward")
    up = torch.randn(y.shape, generator=g)
    assert_close(grads(y, x, up.to(y))[0], grads(expected, xr, up.double())[0], TOL[dtype], "swiglu dx")
    assert_kernel(kernel_calls, "npu_swiglu")


# --- rotary ---------------------------------------------------------------------------------


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = positions.double()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)  # transformers layout
    return emb.cos(), emb.sin()


def rotate_by_hand(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor, rd: int, interleaved: bool):
    """Explicit pair rotation in float64, one pair at a time."""
    out = x.clone()
    for i in range(rd // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
        c, s = cos_half[:, None, i], sin_half[:, None, i]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim,half_width", [(32, False), (64, False), (32, True)])
def test_apply_rotary(accel, kernel_calls, dtype, interleaved, rotary_dim, half_width):
    g = torch.Generator().manual_seed(3)
    dev = accel.device()
    t, h, d = 9, 4, 64
    x = leaf(torch.randn(t, h, d, generator=g), dtype, dev)
    cos, sin = rope_tables(torch.arange(t) * 7 + 3, rotary_dim)
    if half_width:
        cos, sin = cos[:, : rotary_dim // 2], sin[:, : rotary_dim // 2]
    y = accel.ops.apply_rotary(x, cos.to(dev, dtype), sin.to(dev, dtype), rotary_dim, interleaved)
    xr = ref_leaf(x)
    c, s = (cos.to(dtype).double(), sin.to(dtype).double())  # the tables the device op received
    expected = rotate_by_hand(xr, c[:, : rotary_dim // 2], s[:, : rotary_dim // 2], rotary_dim, interleaved)
    assert_close(y, expected, TOL[dtype], "apply_rotary forward")
    assert torch.equal(y[..., rotary_dim:].detach().cpu(), x[..., rotary_dim:].detach().cpu()), "pass-through changed"
    up = torch.randn(y.shape, generator=g)
    assert_close(grads(y, x, up.to(y))[0], grads(expected, xr, up.double())[0], TOL[dtype], "apply_rotary dx")
    assert_kernel(kernel_calls, "npu_rotary_mul")


# --- attention ------------------------------------------------------------------------------


def naive_attention(q, k, v, lq, lk, causal, scale, allowed_extra=None):
    """Per-sequence float64 attention written directly (no shared code with the ops)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    oq = ok = 0
    for sq, sk in zip(lq, lk):
        for i in range(sq):
            for h in range(q.shape[1]):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if allowed_extra is not None:
                    keys = [j for j in keys if j in allowed_extra[oq + i]]
                if not keys:
                    continue
                kk = k[[ok + j for j in keys], h // rep]
                w = torch.softmax((kk @ q[oq + i, h]) * scale, dim=0)
                out[oq + i, h] = w @ v[[ok + j for j in keys], h // rep]
        oq, ok = oq + sq, ok + sk
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
def test_attention_causal_varlen(accel, kernel_calls, dtype, hq, hkv):
    g = torch.Generator().manual_seed(4)
    dev = accel.device()
    lens = [5, 1, 0, 12]  # odd, one-token, zero-length inside the pack
    t, dqk, dv = sum(lens), 24, 16  # Dqk != Dv (MLA-like)
    q = leaf(torch.randn(t, hq, dqk, generator=g), dtype, dev)
    k = leaf(torch.randn(t, hkv, dqk, generator=g), dtype, dev)
    v = leaf(torch.randn(t, hkv, dv, generator=g), dtype, dev)
    out = accel.ops.attention(q, k, v, cu(lens, dev), cu(lens, dev))
    qr, kr, vr = ref_leaf(q), ref_leaf(k), ref_leaf(v)
    expected = R.attention(qr, kr, vr, cu(lens, "cpu"), cu(lens, "cpu"))
    assert_close(expected, naive_attention(qr, kr, vr, lens, lens, True, dqk**-0.5), 1e-12, "reference vs naive")
    assert_close(out, expected, ATTN_TOL[dtype], "attention forward")
    up = torch.randn(out.shape, generator=g)
    got = grads(out, (q, k, v), up.to(out))
    want = grads(expected, (qr, kr, vr), up.double())
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, ATTN_TOL[dtype], f"attention d{name}")
    assert_kernel(kernel_calls, "npu_fusion_attention")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_scale_and_more_keys_than_queries(accel, kernel_calls, causal):
    g = torch.Generator().manual_seed(5)
    dev = accel.device()
    lq, lk = [3, 2, 1], [5, 2, 4]  # bottom-right causal alignment when keys outnumber queries
    q = leaf(torch.randn(sum(lq), 4, 32, generator=g), torch.float32, dev)
    k = leaf(torch.randn(sum(lk), 2, 32, generator=g), torch.float32, dev)
    v = leaf(torch.randn(sum(lk), 2, 32, generator=g), torch.float32, dev)
    out = accel.ops.attention(q, k, v, cu(lq, dev), cu(lk, dev), causal=causal, softmax_scale=0.3)
    expected = naive_attention(ref_leaf(q), ref_leaf(k), ref_leaf(v), lq, lk, causal, 0.3)
    assert_close(out, expected, ATTN_TOL[torch.float32], "attention with explicit scale")
    assert_kernel(kernel_calls, "npu_fusion_attention")


def test_attention_rejects_bad_cu_seqlens(accel):
    q = torch.zeros(4, 2, 8, device=accel.device())
    with pytest.raises(TypeError, match="int32"):
        accel.ops.attention(q, q, q, torch.tensor([0, 4]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="start with 0"):
        bad = torch.tensor([4], dtype=torch.int32)
        accel.ops.attention(q, q, q, bad, bad)


# --- DSA: lightning indexer + sparse attention ----------------------------------------------


def indexer_scores(q, k, w, lens, scale):
    """float64 index scores per sequence: [S, S] with -inf above the causal diagonal."""
    out, o = [], 0
    for s in lens:
        qs, ks, ws = q[o : o + s].double(), k[o : o + s].double(), w[o : o + s].double()
        sc = torch.einsum("shd,td->sht", qs, ks).mul(scale).clamp_min(0)
        sc = torch.einsum("sh,sht->st", ws, sc)
        out.append(sc.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf")))
        o += s
    return out


@pytest.mark.parametrize("topk", [4, 64])
def test_lightning_indexer(accel, kernel_calls, topk):
    g = torch.Generator().manual_seed(6)
    dev = accel.device()
    lens, h, d = [5, 1, 0, 9], 4, 128  # D = 128: the Ascend kernel's head dim
    t = sum(lens)
    q = torch.randn(t, h, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(t, d, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(t, h, generator=g) * h**-0.5).to(dev, torch.bfloat16)
    idx = accel.ops.lightning_indexer(q, k, w, cu(lens, dev), cu(lens, dev), topk, softmax_scale=0.125)
    assert idx.dtype == torch.int32 and idx.shape == (t, topk)
    idx = idx.cpu()
    o = 0
    for s, scores in zip(lens, indexer_scores(q.cpu(), k.cpu(), w.cpu(), lens, 0.125)):
        for i in range(s):
            row = idx[o + i].tolist()
            valid = [j for j in row if j >= 0]
            assert len(valid) == min(i + 1, topk), f"row {o + i}: {row}"
            assert row[len(valid):] == [-1] * (topk - len(valid)), f"-1 slots must come last: {row}"
            assert len(set(valid)) == len(valid) and all(j <= i for j in valid), f"row {o + i}: {row}"
            rest = [j for j in range(i + 1) if j not in valid]
            if rest:  # a true top-k: every chosen score >= every unchosen visible score
                assert scores[i, valid].min() >= scores[i, rest].max() - 1e-9 * scores[i].abs().max()
        o += s
    assert_kernel(kernel_calls, "npu_lightning_indexer")


def test_lightning_indexer_ties_keep_lowest_positions(accel, kernel_calls):
    """Exact ties across the top-k cut (zero keys score 0 for every query, between positive and negative
    scores): the reference (cpu, cuda) keeps the best scores, then the lowest positions, in one decode
    row exactly as in the full sequence. The Ascend kernel's tie order is its own: there only the top-k
    property is checked."""
    g = torch.Generator().manual_seed(14)
    dev = accel.device()
    s, h, d, topk = 13, 4, 128, 4
    k = torch.randn(s, d, generator=g)
    k[[1, 2, 4, 6, 7, 9]] = 0
    q = torch.randn(s, h, d, generator=g).to(dev, torch.bfloat16)
    k = k.to(dev, torch.bfloat16)
    w = (torch.randn(s, h, generator=g) * h**-0.5).to(dev, torch.bfloat16)
    (scores,) = indexer_scores(q.cpu(), k.cpu(), w.cpu(), [s], 0.125)
    ranked = [sorted(range(i + 1), key=lambda j: (-scores[i, j].item(), j)) for i in range(s)]
    assert sum(scores[i, r[topk - 1]] == scores[i, r[topk]] for i, r in enumerate(ranked) if i >= topk) >= 3
    full = accel.ops.lightning_indexer(q, k, w, cu([s], dev), cu([s], dev), topk, softmax_scale=0.125).cpu()
    decode = [accel.ops.lightning_indexer(q[i:i + 1], k[: i + 1], w[i:i + 1], cu([1], dev), cu([i + 1], dev), topk,
                                          softmax_scale=0.125).cpu()[0] for i in range(s)]
    for i in range(s):
        want = ranked[i][:topk]
        for name, row in (("full", full[i]), ("decode", decode[i])):
            got = [j for j in row.tolist() if j >= 0]
            if accel.ops.source("lightning_indexer") == "reference":
                assert got == want, f"{name} row {i}: {got} != {want} (ties -> lowest position)"
            else:  # a true top-k, whichever tied keys the kernel keeps
                assert len(set(got)) == len(want) and scores[i, got].min() >= scores[i, want].min(), f"{name} row {i}"
    assert_kernel(kernel_calls, "npu_lightning_indexer")


def random_topk(lens, topk, g):
    """Per query: topk distinct positions within its sequence (some in the future), -1 padded."""
    rows = []
    for s in lens:
        for _ in range(s):
            n = min(s, topk - 1)
            picks = torch.randperm(s, generator=g)[:n].tolist()
            rows.append(picks + [-1] * (topk - n))
    return torch.tensor(rows, dtype=torch.int32).view(-1, topk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention_general_shapes(accel, kernel_calls, dtype):
    g = torch.Generator().manual_seed(7)
    dev = accel.device()
    lens, h, dqk, dv, topk = [6, 1, 0, 7], 4, 24, 16, 5
    t = sum(lens)
    q = leaf(torch.randn(t, h, dqk, generator=g), dtype, dev)
    k = leaf(torch.randn(t, h, dqk, generator=g), dtype, dev)
    v = leaf(torch.randn(t, h, dv, generator=g), dtype, dev)
    idx = random_topk(lens, topk, g)
    idx[0, :] = -1
    idx[0, 0] = 0  # a query whose only key is itself
    idx[7, :] = -1
    idx[7, 0] = 5  # a query whose only listed key is in the future: it sees nothing and gives 0
    out = accel.ops.sparse_attention(q, k, v, idx.to(dev), cu(lens, dev), cu(lens, dev))
    qr, kr, vr = ref_leaf(q), ref_leaf(k), ref_leaf(v)
    expected = R.sparse_attention(qr, kr, vr, idx, cu(lens, "cpu"), cu(lens, "cpu"))
    starts = [sum(lens[:b]) for b in range(len(lens)) for _ in range(lens[b])]
    chosen = [set(j for j in row if j >= 0) for row in idx.tolist()]
    by_hand = naive_attention(qr, kr, vr, lens, lens, True, dqk**-0.5, [c for c in chosen])
    assert_close(expected, by_hand, 1e-12, "reference vs naive (positions within the sequence)")
    assert len(starts) == t
    assert_close(out, expected, ATTN_TOL[dtype], "sparse_attention forward")
    assert (out[7] == 0).all()
    up = torch.randn(out.shape, generator=g)
    for name, a, b in zip("qkv", grads(out, (q, k, v), up.to(out)), grads(expected, (qr, kr, vr), up.double())):
        assert_close(a, b, ATTN_TOL[dtype], f"sparse_attention d{name}")
    assert_kernel(kernel_calls, "npu_fusion_attention")


def test_sparse_attention_absorbed_mla(accel, kernel_calls):
    """One latent kv head (512 + 64 rope), v = k's latent part: the npu_sparse_flash_attention shapes."""
    g = torch.Generator().manual_seed(8)
    dev = accel.device()
    lens, h, topk = [4, 3], 2, 3
    t = sum(lens)
    q = leaf(torch.randn(t, h, 576, generator=g) * 0.1, torch.bfloat16, dev)
    k = leaf(torch.randn(t, 1, 576, generator=g) * 0.1, torch.bfloat16, dev)
    idx = random_topk(lens, topk, g)
    out = accel.ops.sparse_attention(q, k, k[..., :512], idx.to(dev), cu(lens, dev), cu(lens, dev), softmax_scale=0.05)
    qr, kr = ref_leaf(q), ref_leaf(k)
    expected = R.sparse_attention(qr, kr, kr[..., :512], idx, cu(lens, "cpu"), cu(lens, "cpu"), softmax_scale=0.05)
    assert_close(out, expected, ATTN_TOL[torch.bfloat16], "absorbed sparse attention forward")
    up = torch.randn(out.shape, generator=g)
    for name, a, b in zip("qk", grads(out, (q, k), up.to(out)), grads(expected, (qr, kr), up.double())):
        assert_close(a, b, ATTN_TOL[torch.bfloat16], f"absorbed sparse attention d{name}")
    assert_kernel(kernel_calls, "npu_sparse_flash_attention")


# --- MoE ------------------------------------------------------------------------------------


def by_expert(weights: torch.Tensor, indices: torch.Tensor):
    """Slot order is implementation-defined: sort each row's (expert, weight) pairs by expert id."""
    order = indices.argsort(dim=-1)
    return weights.gather(1, order), indices.gather(1, order)


@pytest.mark.parametrize("n_group,topk_group,top_k", [(1, 1, 4), (4, 2, 3)])
def test_moe_route(accel, kernel_calls, n_group, topk_group, top_k):
    g = torch.Generator().manual_seed(9)
    dev = accel.device()
    logits = leaf(torch.randn(11, 16, generator=g), torch.float32, dev)
    bias = (torch.randn(16, generator=g) * 0.3).to(dev)
    w, idx = accel.ops.moe_route(logits, bias, top_k, n_group, topk_group, 2.5, True)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (11, top_k)
    lr = ref_leaf(logits)
    wr, ir = R.moe_route(lr, bias.double().cpu(), top_k, n_group, topk_group, 2.5, True)
    (ws, is_), (wrs, irs) = by_expert(w, idx), by_expert(wr, ir)
    assert torch.equal(is_.cpu(), irs), "chosen experts differ"
    assert_close(ws, wrs, TOL[torch.float32], "routing weights")
    assert_close(ws.sum(-1), torch.full((11,), 2.5, dtype=torch.float64), 1e-6, "weights sum to the scaling factor")
    up = torch.randn(11, 16, generator=g)  # one upstream value per (token, expert): order-free
    loss = (w * up.to(dev).gather(1, idx)).sum()
    loss_r = (wr * up.double().gather(1, ir)).sum()
    assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(loss_r, lr)[0], TOL[torch.float32], "dlogits")
    assert_kernel(kernel_calls, "npu_moe_gating_top_k")


def test_moe_route_ties_and_unnormalised(accel):
    dev = accel.device()
    logits = torch.zeros(3, 8, device=dev)  # every score ties
    logits[1, 5] = 1.0
    w, idx = accel.ops.moe_route(logits, None, 2, 2, 1, 1.0, True)
    assert torch.allclose(w.sum(-1).cpu(), torch.ones(3)) and (idx >= 0).all() and (idx < 8).all()
    assert 5 in idx[1].tolist(), "the single highest expert must be chosen"
    groups = (idx // 4).cpu()
    assert (groups == groups[:, :1]).all(), "topk_group=1: both experts from one group"
    w2, idx2 = accel.ops.moe_route(logits, None, 2, 1, 1, 1.5, False)
    assert torch.allclose(w2.cpu(), torch.sigmoid(logits.cpu()).gather(1, idx2.cpu()) * 1.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute_unpermute(accel, kernel_calls, dtype):
    g = torch.Generator().manual_seed(10)
    dev = accel.device()
    t, kk, hidden, experts = 7, 3, 12, 5
    indices = torch.stack([torch.randperm(experts - 1, generator=g)[:kk] for _ in range(t)])  # expert 4 gets no tokens
    tokens = leaf(torch.randn(t, hidden, generator=g), dtype, dev)
    permuted, sort_map = accel.ops.moe_permute(tokens, indices.to(dev))
    assert sort_map.dtype == torch.int32 and permuted.shape == (t * kk, hidden)
    flat_experts = indices.flatten()
    experts_of_rows = torch.empty_like(flat_experts)
    experts_of_rows[sort_map.long().cpu()] = flat_experts
    assert (experts_of_rows.diff() >= 0).all(), "permuted rows must be grouped by expert"
    for i in range(t * kk):
        assert torch.equal(permuted[sort_map[i]].detach().cpu(), tokens[i // kk].detach().cpu())
    pr, smr = R.moe_permute(ref_leaf(tokens), indices)
    assert torch.equal(sort_map.cpu(), smr), "copies within an expert must stay in (token, k) order"
    weights = leaf(torch.rand(t, kk, generator=g), torch.float32, dev)
    out = accel.ops.moe_unpermute(permuted, sort_map, weights)
    assert out.shape == (t, hidden) and out.dtype == dtype
    tr, wr = ref_leaf(tokens), ref_leaf(weights)
    expected = (tr.unsqueeze(1) * wr.unsqueeze(-1)).sum(1)  # permute + weighted unpermute, by definition
    assert_close(out, expected, TOL[dtype], "permute -> unpermute")
    up = torch.randn(out.shape, generator=g)
    dt, dw = grads(out, (tokens, weights), up.to(out))
    dtr, dwr = grads(expected, (tr, wr), up.double())
    assert_close(dt, dtr, TOL[dtype], "d tokens")
    assert_close(dw, dwr, TOL[dtype] * 2, "d weights")
    if dtype == torch.bfloat16:  # torch_npu documents bfloat16 tokens only: other dtypes run the reference
        assert_kernel(kernel_calls, "npu_moe_token_permute")
        assert_kernel(kernel_calls, "npu_moe_token_unpermute")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul(accel, kernel_calls, dtype):
    g = torch.Generator().manual_seed(11)
    dev = accel.device()
    counts = torch.tensor([3, 0, 5, 1])  # expert 1 receives no tokens
    x = leaf(torch.randn(int(counts.sum()), 8, generator=g), dtype, dev)
    w = leaf(torch.randn(4, 8, 6, generator=g), dtype, dev)
    y = accel.ops.grouped_matmul(x, w, counts.to(dev))
    xr, wr = ref_leaf(x), ref_leaf(w)
    rows = torch.repeat_interleave(torch.arange(4), counts)
    expected = torch.einsum("tk,tkn->tn", xr, wr[rows])
    assert_close(y, expected, TOL[dtype], "grouped_matmul forward")
    up = torch.randn(y.shape, generator=g)
    dx, dw = grads(y, (x, w), up.to(y))
    dxr, dwr = grads(expected, (xr, wr), up.double())
    assert_close(dx, dxr, TOL[dtype], "grouped_matmul dx")
    assert_close(dw, dwr, TOL[dtype] * 2, "grouped_matmul dw")
    assert (dw[1] == 0).all(), "an expert without tokens gets a zero gradient"
    with pytest.raises(ValueError, match="tokens_per_expert"):
        accel.ops.grouped_matmul(x, w, torch.tensor([3, 0, 5, 2], device=dev))
    assert_kernel(kernel_calls, "npu_grouped_matmul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_ops_take_zero_tokens(accel, dtype):
    """A rank that routes or receives no tokens (expert parallel): every MoE op takes T = 0 forward and
    backward, keeps the shapes, and gives zero (not undefined) expert weight grads."""
    dev = accel.device()
    g = torch.Generator().manual_seed(13)
    hidden, experts, top_k, ffn = 12, 8, 2, 8
    logits = leaf(torch.zeros(0, experts), torch.float32, dev)
    tokens = leaf(torch.zeros(0, hidden), dtype, dev)
    w1 = leaf(torch.randn(experts, hidden, 2 * ffn, generator=g), dtype, dev)
    w2 = leaf(torch.randn(experts, ffn, hidden, generator=g), dtype, dev)
    weights, indices = accel.ops.moe_route(logits, torch.zeros(experts, device=dev), top_k, 2, 1, 2.5, True)
    assert weights.shape == indices.shape == (0, top_k)
    permuted, sort_map = accel.ops.moe_permute(tokens, indices)
    assert permuted.shape == (0, hidden) and sort_map.shape == (0,) and sort_map.dtype == torch.int32
    counts = torch.bincount(indices.reshape(-1), minlength=experts)
    h = accel.ops.swiglu(accel.ops.grouped_matmul(permuted, w1, counts))
    assert h.shape == (0, ffn)
    out = accel.ops.moe_unpermute(accel.ops.grouped_matmul(h, w2, counts), sort_map, weights)
    assert out.shape == (0, hidden) and out.dtype == dtype
    d_logits, d_tokens, d_w1, d_w2 = torch.autograd.grad(out.sum(), (logits, tokens, w1, w2), allow_unused=True)
    assert d_logits is None or d_logits.shape == (0, experts)
    assert d_tokens is None or d_tokens.shape == (0, hidden)
    for name, d in (("w1", d_w1), ("w2", d_w2)):
        assert d is None or (d.shape == (w1 if name == "w1" else w2).shape and (d == 0).all()), f"d{name} must be 0"
    # The expert-parallel regroup: received rows with one copy each and weight 1 (moe.py), none received.
    none = torch.zeros(0, hidden, device=dev, dtype=dtype)
    back = accel.ops.moe_unpermute(none, torch.zeros(0, dtype=torch.int32, device=dev),
                                   torch.ones(0, 1, device=dev))
    assert back.shape == (0, hidden)


# --- log-probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_token_log_probs(accel, dtype, chunk_size):
    g = torch.Generator().manual_seed(12)
    dev = accel.device()
    logits = leaf(torch.randn(2, 5, 37, generator=g) * 3, dtype, dev)
    tokens = torch.randint(0, 37, (2, 5), generator=g)
    lp, ent = accel.ops.token_log_probs(logits, tokens.to(dev), chunk_size=chunk_size)
    assert lp.shape == ent.shape == (2, 5) and lp.dtype == torch.float32
    lr = ref_leaf(logits)
    logp = torch.log_softmax(lr, dim=-1)
    lp_r = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent_r = -(logp.exp() * logp).sum(-1)
    assert_close(lp, lp_r, 1e-5, "log_probs")
    assert_close(ent, ent_r, 1e-5, "entropy")
    a, b = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    got = torch.autograd.grad((lp * a.to(dev)).sum() + (ent * b.to(dev)).sum(), logits)[0]
    want = torch.autograd.grad((lp_r * a.double()).sum() + (ent_r * b.double()).sum(), lr)[0]
    assert got.dtype == dtype
    assert_close(got, want, TOL[dtype] if dtype != torch.float32 else 1e-5, "dlogits")
    with pytest.raises(ValueError, match="token ids"):
        accel.ops.token_log_probs(logits, torch.full((2, 5), 37, device=dev))


def test_token_log_probs_memory_is_chunked():
    """The saved state is the logits plus O(T) statistics, not a [T, V] float32 softmax."""
    logits = torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 1000, (64,))
    lp, _ = R.token_log_probs(logits, tokens, chunk_size=8)
    saved = [t for t in lp.grad_fn.saved_tensors] if hasattr(lp.grad_fn, "saved_tensors") else []
    big = [t for t in saved if t.numel() >= logits.numel() and t.dtype == torch.float32]
    assert not big, "a float32 [T, V] tensor is kept for backward"
    assert math.isclose(float(lp.detach().sum()), float(torch.log_softmax(logits.detach().float(), -1).gather(1, tokens[:, None]).sum()), rel_tol=1e-5)
