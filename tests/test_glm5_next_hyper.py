"""glm5_next mHC hyper-connection with its backward written out (slime_plugins/models/glm5_next/hyper.py):
outputs and every grad (fn, base, scale, the streams) against transformers' formula evaluated in float64, with
transformers' own float32 module as the yardstick of float32 rounding; bf16 streams and weights; what autograd
keeps between forward and backward; unused outputs, streams without grad and the no-grad path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_plugins.models.glm5_next.config import from_hf
from slime_plugins.models.glm5_next.hyper import HyperConnection
from slime_plugins.models.glm5_next.tiny import tiny_config


def _reference64(streams, fn, base, scale, hc: int, iterations: int, eps: float, norm_eps: float):
    """transformers' Glm5NextTextHyperConnection.forward, every op in float64 (its module casts to float32)."""
    s = streams.double()
    x = s.flatten(-2)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = F.linear(x, fn.double()).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.double().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.double().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * s).sum(-2)


def _modules(hc: int, hidden: int, dtype=torch.float32, seed: int = 0):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    config = tiny_config("glm5_next_text", hidden_size=hidden, hc_mult=hc)
    ours, theirs = HyperConnection(from_hf(config.to_dict()), dtype, False), Glm5NextTextHyperConnection(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            value = torch.randn(getattr(ours, name).shape, generator=g) * (0.05 if name == "fn" else 0.5)
            getattr(ours, name).copy_(value)
            getattr(theirs, name).copy_(getattr(ours, name))  # ours' fn rounded to bf16 where ours is bf16
    return ours, theirs


def _fwd_bwd(forward, params, streams, weights):
    streams = streams.detach().requires_grad_(True)
    outs = forward(streams)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    return [o.detach().double() for o in outs], [g.double() for g in torch.autograd.grad(loss, [*params, streams])]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


NAMES = ("post", "comb", "block input", "d fn", "d base", "d scale", "d streams")


@pytest.mark.parametrize("shape", [(2, 7, 4, 48), (1, 33, 3, 40), (3, 1, 1, 16), (1, 129, 4, 96)])
def test_outputs_and_grads_match_float64_reference(shape):
    batch, seq, hc, hidden = shape
    ours, theirs = _modules(hc, hidden, seed=seq)
    arch = (hc, ours.iterations, ours.hc_eps, ours.norm_eps)
    g = torch.Generator().manual_seed(1 + seq)
    streams = torch.randn(batch, seq, hc, hidden, generator=g) * 3
    weights = [torch.randn(batch, seq, hc, generator=g, dtype=torch.float64),
               torch.randn(batch, seq, hc, hc, generator=g, dtype=torch.float64),
               torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)]
    params = [ours.fn, ours.base, ours.scale]
    got = _fwd_bwd(ours, params, streams, weights)
    hf = _fwd_bwd(theirs, [theirs.fn, theirs.base, theirs.scale], streams, weights)
    ref = _fwd_bwd(lambda s: _reference64(s, *params, *arch), params, streams, weights)
    for name, a, b, want in zip(NAMES, got[0] + got[1], hf[0] + hf[1], ref[0] + ref[1]):
        ours_err, hf_err = _rel(a, want), _rel(b, want)
        # float32 rounding only: within 4x transformers' own float32 error (or 1e-6 where that is ~0)
        assert ours_err <= max(4 * hf_err, 1e-6), (name, ours_err, hf_err)
        assert ours_err < 1e-5, (name, ours_err)


def test_bf16_streams_and_weights():
    """The model's dtype: bf16 streams and fn (base, scale float32); the grads come back in each input's dtype and
    agree with the float64 reference to bf16 rounding."""
    ours, _ = _modules(4, 64, dtype=torch.bfloat16)
    assert (ours.fn.dtype, ours.base.dtype, ours.scale.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(2, 9, 4, 64, generator=g).bfloat16().requires_grad_(True)
    post, comb, block_in = ours(streams)
    assert (post.dtype, comb.dtype, block_in.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in (post, comb, block_in)]
    loss = sum((o.double() * w).sum() for o, w in zip((post, comb, block_in), weights))
    grads = torch.autograd.grad(loss, [ours.fn, ours.base, ours.scale, streams])
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    params = [ours.fn, ours.base, ours.scale]
    ref_out, ref_grads = _fwd_bwd(lambda s: _reference64(s, *params, 4, ours.iterations, ours.hc_eps, ours.norm_eps),
                                  params, streams, weights)
    for name, a, want in zip(NAMES, [post, comb, block_in, *grads], ref_out + ref_grads):
        assert _rel(a.detach().double(), want) < 2e-2, name


def test_backward_keeps_small_per_token_state():
    """Autograd keeps the streams, fn and two small tensors (the per-token mix logits + RMS factor, and base /
    scale): (2 + hc) * hc + 1 floats per token beyond the streams, not the normalised streams or Sinkhorn steps."""
    ours, _ = _modules(4, 48)
    tokens = 2 * 37
    streams = torch.randn(2, 37, 4, 48, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours(streams)
    assert len(saved) == 4
    assert saved[0].data_ptr() == streams.data_ptr() and saved[1] is ours.fn
    assert saved[2].shape == (tokens, (2 + 4) * 4 + 1) and saved[3].numel() == (2 + 4) * 4 + 3


def test_unused_outputs_streams_without_grad_and_no_grad():
    ours, theirs = _modules(3, 32)
    streams = torch.randn(5, 3, 32)  # no batch dim, streams without grad
    post, comb, block_in = ours(streams)
    d_fn, d_base = torch.autograd.grad(block_in.square().sum(), [ours.fn, ours.base])  # post, comb unused
    t_post, t_comb, t_in = theirs(streams.unsqueeze(0))
    want = torch.autograd.grad(t_in.square().sum(), [theirs.fn, theirs.base])
    assert _rel(d_fn, want[0]) < 1e-5 and _rel(d_base, want[1]) < 1e-5
    with torch.no_grad():
        again = ours(streams)
    assert all(not t.requires_grad for t in again)
    for a, b in zip(again, (post, comb, block_in)):
        assert torch.equal(a, b.detach())
    assert _rel(again[1], t_comb[0]) < 1e-6 and _rel(again[2], t_in[0]) < 1e-6
