"""mHC (manifold-constrained hyper-connections) of GLM-5.3-Flash, in transformers' op order.

The hidden state of every token is `hc_mult` residual streams. Around each attention and MLP block a
`HyperConnection` reads all streams (flattened, unweighted-RMS-normalised, one float32 linear map `fn`) and
gives three per-token weights: `pre` [hc] collapses the streams into the block's input, `post` [hc] spreads the
block's output over the streams, `comb` [hc, hc] (softmax, then Sinkhorn towards a doubly stochastic matrix)
mixes the residual streams: new[i] = post[i] * block_out + sum_j comb[j, i] * old[j].

Layout: megatron's activations are [S, B, hc * H] (stream-major in the last dim) so that sequence parallel
scatters / gathers, pipeline send / receive (one 3-D tensor, its shape exchanged per micro-batch) and
activation recompute treat the streams as any hidden state; the math reshapes to [S, B, hc, H].
Everything here is per token: it runs on a rank's sequence-parallel slice unchanged, and its parameters'
grads are then partial per TP rank (marked `sequence_parallel`, summed by megatron).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_plugins.models.common.layers import KeepsFloat32, RMSNorm


def expand_streams(hidden: torch.Tensor, hc: int) -> torch.Tensor:
    """[S, B, H] (the embedding) -> [S, B, hc * H]: every stream starts as the token's embedding."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], hc, hidden.shape[-1]).reshape(*hidden.shape[:-1], -1)


def sinkhorn(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation of [..., hc, hc] (columns first and last, transformers' order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(KeepsFloat32, torch.nn.Module):
    """One block's mHC weights: fn [(2 + hc) * hc, hc * H] (model dtype, used in float32), base
    [(2 + hc) * hc] and scale [3] (float32, as transformers keeps them). HF: `hc_attn_fn` / `hc_attn_base` /
    `hc_attn_scale` (and `hc_ffn_*`) of the decoder layer."""

    float32_names = ("base", "scale")

    def __init__(self, arch, dtype: torch.dtype, sequence_parallel: bool) -> None:
        super().__init__()
        hc = self.hc = arch.hc_mult
        self.iterations, self.hc_eps, self.norm_eps = arch.hc_sinkhorn_iters, arch.hc_eps, arch.rms_norm_eps
        width = (2 + hc) * hc
        self.fn = torch.nn.Parameter(torch.empty(width, hc * arch.hidden_size, dtype=dtype))
        self.base = torch.nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
        torch.nn.init.normal_(self.fn, std=0.02)
        for p in self.parameters():  # each TP rank sees its own tokens: grads summed over TP
            p.sequence_parallel = sequence_parallel

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., hc, H] -> (post [..., hc] float32, comb [..., hc, hc] float32, block input [..., H])."""
        settings = (self.hc, self.iterations, self.hc_eps, self.norm_eps)
        post, comb, collapsed = _HyperConnectionFunction.apply(streams, self.fn, self.base, self.scale, settings)
        lead = streams.shape[:-2]
        return post.view(*lead, self.hc), comb.view(*lead, self.hc, self.hc), collapsed.view(*lead, -1)


def mix_weights(logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iterations: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token mix logits [T, (2+hc)*hc] (the normalised streams times fn) -> (pre [T, hc], post [T, hc],
    comb [T, hc, hc]), float32, in transformers' op order."""
    pre_w, post_w, comb_w = logits.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + eps
    return pre, post, sinkhorn(comb, iterations, eps)


class _HyperConnectionFunction(torch.autograd.Function):
    """The hyper-connection with its backward written out: autograd would keep the float32 normalised streams
    (hc x a float32 hidden state per token, twice per layer) and every Sinkhorn step, and recomputing all of it in
    backward (torch.utils.checkpoint) replays the big reads and the matmul. Kept instead: the streams (which the
    merge keeps anyway), fn, and per token the (2+hc)*hc mix logits and the RMS factor; the backward replays only
    the [T, (2+hc)*hc] sigmoid / softmax / Sinkhorn part under autograd. The normalisation is folded into the
    logits ((x @ fn^T) * rstd for (x * rstd) @ fn^T, rounding-level apart), so no normalised copy of the streams
    is ever made, and the collapse and its grads are batched matmuls, not [T, hc, H] temporaries."""

    @staticmethod
    def forward(ctx, streams, fn, base, scale, settings):
        hc, iterations, hc_eps, norm_eps = settings
        x = streams.reshape(-1, streams.shape[-2] * streams.shape[-1]).float()  # [T, hc * H]
        rstd = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + norm_eps)
        logits = F.linear(x, fn.float()) * rstd
        pre, post, comb = mix_weights(logits, base, scale, hc, iterations, hc_eps)
        collapsed = torch.bmm(pre.unsqueeze(-2), x.view(x.shape[0], hc, -1)).squeeze(-2).to(streams.dtype)
        ctx.settings = settings
        # the mix logits, the RMS factor and base / scale as of this forward, each packed into one small tensor
        ctx.save_for_backward(streams, fn, torch.cat([logits, rstd], dim=-1), torch.cat([base, scale]).detach())
        return post, comb, collapsed

    @staticmethod
    def backward(ctx, d_post, d_comb, d_collapsed):
        hc, iterations, hc_eps, _ = ctx.settings
        streams, fn, per_token, constants = ctx.saved_tensors
        logits, rstd = per_token.split([per_token.shape[-1] - 1, 1], dim=-1)
        x = streams.reshape(-1, streams.shape[-2] * streams.shape[-1]).float()
        x3 = x.view(x.shape[0], hc, -1)
        d_collapsed = d_collapsed.reshape(x.shape[0], -1).float()
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (logits, *constants.split([logits.shape[-1], 3]))]
            pre, post, comb = mix_weights(*leaves, hc, iterations, hc_eps)
        d_pre = torch.bmm(d_collapsed.unsqueeze(-2), x3.transpose(-1, -2)).squeeze(-2)  # sum_H dc * x_i
        with torch.enable_grad():
            d_logits, d_base, d_scale = torch.autograd.grad((pre, post, comb), leaves, (d_pre, d_post, d_comb))
        scaled = d_logits * rstd  # the grad of x @ fn^T
        d_fn = (scaled.t() @ x).to(fn.dtype) if ctx.needs_input_grad[1] else None
        d_streams = None
        if ctx.needs_input_grad[0]:
            d_x = scaled @ fn.float()
            # through rstd = (|x|^2 / n + eps)^-1/2: d rstd / dx = -rstd^3 x / n
            d_x.addcmul_(x, (d_logits * logits).sum(-1, keepdim=True) * rstd.square() / x.shape[-1], value=-1)
            d_x.view_as(x3).addcmul_(pre.detach().unsqueeze(-1), d_collapsed.unsqueeze(-2))  # the collapse
            d_streams = d_x.view(streams.shape).to(streams.dtype)
        return d_streams, d_fn, d_base, d_scale, None


def merge_streams(block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor:
    """post[i] * block_out + sum_j comb[j, i] * residual[j], in the streams' dtype (transformers' casts):
    block_out [..., H], post [..., hc], comb [..., hc, hc], residual [..., hc, H] -> [..., hc, H]."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 residual)


class StreamCollapseNorm(RMSNorm):
    """The decoder's final norm: the unweighted mean of the streams ([..., hc * H] -> [..., H]), then RMSNorm.
    Built by megatron's TransformerBlock as its final layer norm (config, hidden_size, eps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.weight.shape[0]
        return super().forward(x.view(*x.shape[:-1], -1, hidden).mean(dim=-2))
