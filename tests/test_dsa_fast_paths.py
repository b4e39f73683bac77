"""Shortcuts of the attention / MoE reference ops and of the GLM-5 DSA layer, against the general paths
they replace, in float64 on odd shapes:
- a [B, S] batch (equal-length sequences, computed stacked) equals each sequence computed alone
  (attention, sparse_attention, lightning_indexer: outputs, top-k and grads; tolerance 1e-12);
- grouped_matmul's grads (experts without tokens included) equal per-expert matmuls (1e-12);
- DSA with index_topk >= the key count selects every causal key, so sparse attention over the indexer's
  choice equals dense causal attention (exactly), and the model's skip of the indexer there gives the
  masked path's logits and grads (1e-12)."""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.ops import reference as ref

F64 = torch.float64


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _alone(fn, tensors_q, tensors_k, n, sq, sk, *extra, **kw):
    """fn on each sequence alone, outputs concatenated."""
    one_q, one_k = _cu([sq]), _cu([sk])
    outs = []
    for b in range(n):
        qs = [t[b * sq:(b + 1) * sq] for t in tensors_q]
        ks = [t[b * sk:(b + 1) * sk] for t in tensors_k]
        outs.append(fn(*qs[:1], *ks, *qs[1:], one_q, one_k, *extra, **kw))
    return torch.cat(outs)


@pytest.mark.parametrize("sq, sk, heads, kv_heads", [(7, 7, 3, 3), (5, 9, 4, 2), (9, 5, 2, 1)])
def test_stacked_attention_equals_each_sequence_alone(sq, sk, heads, kv_heads):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    n = 3
    q = torch.randn(n * sq, heads, 6, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(n * sk, kv_heads, 6, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(n * sk, kv_heads, 5, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(n * sq, heads, 5, generator=g, dtype=F64)
    for causal in (True, False):
        got = ref.attention(q, k, v, _cu([sq] * n), _cu([sk] * n), causal=causal, softmax_scale=0.3)
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        want = _alone(ref.attention, [q], [k, v], n, sq, sk, causal=causal, softmax_scale=0.3)
        want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    topk = 4
    idx = torch.stack([torch.randperm(sk + 2, generator=g)[:topk] - 1 for _ in range(n * sq)]).to(torch.int32)
    idx = idx.clamp(max=sk - 1)  # -1 (unused) and repeated positions included
    got = ref.sparse_attention(q, k, v, idx, _cu([sq] * n), _cu([sk] * n), softmax_scale=0.3)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want = _alone(lambda q_, k_, v_, i_, cq, ck, **kw: ref.sparse_attention(q_, k_, v_, i_, cq, ck, **kw),
                  [q, idx], [k, v], n, sq, sk, softmax_scale=0.3)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sq, sk, topk", [(7, 7, 3), (5, 9, 12), (9, 5, 4)])
def test_stacked_indexer_equals_each_sequence_alone(sq, sk, topk):
    g = torch.Generator().manual_seed(sq + 7 * sk)
    n = 3
    q = torch.randn(n * sq, 2, 8, generator=g, dtype=F64)
    k = torch.randn(n * sk, 1, 8, generator=g, dtype=F64)
    k[2] = k[1]  # tied scores: the lowest position wins on both paths
    weights = torch.randn(n * sq, 2, generator=g, dtype=F64)
    got = ref.lightning_indexer(q, k, weights, _cu([sq] * n), _cu([sk] * n), topk)
    want = torch.cat([ref.lightning_indexer(q[b * sq:(b + 1) * sq], k[b * sk:(b + 1) * sk], weights[b * sq:(b + 1) * sq],
                                            _cu([sq]), _cu([sk]), topk) for b in range(n)])
    assert torch.equal(got, want)
    assert (got == -1).any() and (got >= 0).any()


def test_grouped_matmul_grads_equal_per_expert_matmuls():
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 5, 0, 1])
    x = torch.randn(int(counts.sum()), 6, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(5, 6, 4, generator=g, dtype=F64, requires_grad=True)
    out = ref.grouped_matmul(x, w, counts)
    dy = torch.randn_like(out)
    dx, dw = torch.autograd.grad((out * dy).sum(), (x, w))
    rows = torch.repeat_interleave(torch.arange(5), counts)
    want = torch.einsum("tk,tkn->tn", x.detach(), w.detach()[rows])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(dx, torch.einsum("tn,tkn->tk", dy, w.detach()[rows]), rtol=0, atol=1e-12)
    want_dw = torch.zeros_like(w).index_add_(0, rows, torch.einsum("tk,tn->tkn", x.detach(), dy))
    torch.testing.assert_close(dw, want_dw, rtol=0, atol=1e-12)
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(dw[3]) == 0


@pytest.mark.parametrize("lengths", [[7], [5, 5], [6, 1, 3]])
def test_sparse_attention_over_every_key_is_dense_causal_attention(lengths):
    """What the DSA layer's skip relies on: index_topk >= the key count selects every causal key."""
    g = torch.Generator().manual_seed(len(lengths))
    total, cu = sum(lengths), _cu(lengths)
    q = torch.randn(total, 3, 6, generator=g, dtype=F64)
    k = torch.randn(total, 3, 6, generator=g, dtype=F64)
    v = torch.randn(total, 3, 5, generator=g, dtype=F64)
    iq = torch.randn(total, 2, 8, generator=g, dtype=F64)
    ik = torch.randn(total, 8, generator=g, dtype=F64)
    topk = ref.lightning_indexer(iq, ik, torch.randn(total, 2, generator=g, dtype=F64), cu, cu, total)
    sparse = ref.sparse_attention(q, k, v, topk, cu, cu, softmax_scale=0.4)
    assert torch.equal(sparse, ref.attention(q, k, v, cu, cu, softmax_scale=0.4))


def test_dsa_layer_skips_the_indexer_only_when_no_key_is_dropped(tmp_path, monkeypatch):
    """The model at seq <= index_topk (indexer skipped) gives the masked sparse path's logits and grads."""
    from glm5_helpers import random_batch, write_checkpoint

    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.glm5 import attention

    model = load_hf_model(write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=2), dtype=F64)
    assert model.arch.index_topk == 8
    calls = []
    indexer_forward = attention.DsaIndexer.forward
    monkeypatch.setattr(attention.DsaIndexer, "forward", lambda self, *a: calls.append(1) or indexer_forward(self, *a))

    def logits_and_grads(ids, pos):
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos)
        (logits * torch.linspace(-1, 1, logits.numel(), dtype=F64).view_as(logits)).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ids, pos = random_batch(2, 7, 512, 0)
    fast, fast_grads = logits_and_grads(ids, pos)
    assert not calls  # 7 keys <= index_topk: every key is kept, no indexer
    monkeypatch.setattr(attention.MLASelfAttention, "may_drop_keys", lambda self, ctx: True)
    masked, masked_grads = logits_and_grads(ids, pos)
    assert calls
    torch.testing.assert_close(fast, masked, rtol=0, atol=1e-12)
    assert fast_grads.keys() == masked_grads.keys() and len(fast_grads) > 20
    for name, g in masked_grads.items():
        torch.testing.assert_close(fast_grads[name], g, rtol=0, atol=1e-12, msg=name)
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(attention.DsaIndexer, "forward", lambda self, *a: calls.append(1) or indexer_forward(self, *a))
    model(*random_batch(1, 9, 512, 1))  # 9 keys > index_topk: the indexer runs
    assert calls
