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
import torch.utils.checkpoint

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
        if torch.is_grad_enabled():
            # Recomputed in backward: autograd would keep the float32 normalised streams (4 x a float32 hidden state
            # per token, twice per layer) and every Sinkhorn step; recomputing costs one [hc*H, (2+hc)*hc] matmul.
            pre, post, comb = torch.utils.checkpoint.checkpoint(self._weights, streams, use_reentrant=False)
        else:
            pre, post, comb = self._weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed

    def _weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [..., hc], post [..., hc], comb [..., hc, hc]), float32."""
        hc = self.hc
        flat = streams.flatten(-2).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iterations, self.hc_eps)


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
