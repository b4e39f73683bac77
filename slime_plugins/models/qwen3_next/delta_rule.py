"""The Gated DeltaNet token mixer's sequence math in plain torch (any accelerator; autograd for the backward):
per-sequence causal depthwise convolution and the gated delta rule in its chunked (WY) form.

The gated delta rule, per value head, with a state S [dk, dv] starting at 0 for every sequence:
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t
(q, k L2-normalised, q scaled by dk^-0.5). Within a chunk of C tokens with cumulative log-decay G_i the
updates u solve the unit lower-triangular system (I + A) U = beta V - beta K exp(G) S0, with
A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i; then o_i = exp(G_i) q_i^T S0 + sum_{j <= i} (q_i . k_j)
exp(G_i - G_j) u_j and the chunk hands on S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T. Work is
O(T C) per head plus one sequential step per chunk. Everything runs in float32 (the reference kernels'
precision) and returns the input dtype.

Packed THD tokens are laid out per sequence ([N, L_max] with zero padding at the end), so neither the
convolution nor the recurrence crosses a sequence boundary; padded steps have k = 0, beta = 0, g = 0 and
leave the state unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def to_padded(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[T, ...] packed sequences -> [N, L_max, ...], zeros after each sequence's end."""
    return torch.nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=True)


def from_padded(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[N, L_max, ...] -> [T, ...]: each sequence's first `length` rows, in order."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)], dim=0)


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution then SiLU: x [N, L, C], weight [C, 1, K] -> [N, L, C]."""
    length, kernel = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, padding=kernel - 1, groups=x.shape[-1])[..., :length]
    return F.silu(y).transpose(1, 2).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     chunk: int = CHUNK) -> torch.Tensor:
    """q, k [N, L, H, dk] (one key per value head: grouped heads already repeated), v [N, L, H, dv],
    g (log-decay, <= 0) and beta [N, L, H] -> o [N, L, H, dv] in v's dtype."""
    dtype = v.dtype
    n, length, heads, dk = k.shape
    q = l2_normalize(q.float()) * dk ** -0.5
    k = l2_normalize(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    pad = (-length) % chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [N, L, H, ...] -> [N, H, chunks, C, ...]
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(n, heads, -1, chunk, *x.shape[3:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    decay = g.cumsum(-1)  # G_i within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # A (its diagonal is ignored: unit triangular)
    rhs = torch.cat([v * beta[..., None], k_beta * decay.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system.tril(-1) + torch.eye(chunk, dtype=system.dtype, device=system.device),
                                           rhs, upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], dk], dim=-1)  # U = u0 - w S0
    scores = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = q.new_zeros(n, heads, dk, v.shape[-1])
    out = []
    for c in range(q.shape[2]):
        u = u0[:, :, c] - w[:, :, c] @ state
        out.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(n, heads, -1, v.shape[-1])[:, :, :length]
    return o.transpose(1, 2).to(dtype)
