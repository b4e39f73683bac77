"""Reference ops of Kimi Delta Attention (KDA, GLM-5.3-Flash's linear-attention layers): the chunked delta rule
with a per-channel decay, the per-sequence short causal convolution and the KDA forget gate. Pure torch; autograd
gives the backward. The op table finds them through REFERENCE_MODULES (slime/accelerator/ops/__init__.py).

The KDA recurrence, per head, with a state S [dk, dv] that starts at 0 for every sequence:
    S_t = diag(exp(g_t)) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t),   o_t = S_t^T q_t
(q, k L2-normalised, q scaled by dk^-0.5). Gated DeltaNet has one decay per head; here every key channel d decays
by its own g_t[d]. Within a chunk of C tokens with cumulative log-decay G_i[d] the updates solve the unit lower-
triangular system (I + A) U = beta V - beta (K * exp(G)) S0 with A_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)
(j < i); o_i = (q_i * exp(G_i))^T S0 + sum_{j <= i} P_ij u_j with P_ij = sum_d q_id k_jd exp(G_id - G_jd).

The per-channel factor exp(G_id - G_jd) does not split into a row and a column factor without overflow in general,
so the chunk is cut into sub-blocks of SUB tokens: a pair of different sub-blocks (i in block a, j in an earlier
block) uses the decay at the first token r of block a as a pivot, exp(G_i - G_r) * exp(G_r - G_j), both factors
<= 1 (G is non-increasing), which turns the pair into a matmul; a pair inside one sub-block is computed exactly
from the [SUB, SUB, dk] differences. With U = U0 - W S0, M = Q exp(G) - P W, a chunk reduces to
    o = P U0 + M S0,   S_next = (diag(exp(G_C)) - K_end^T W) S0 + K_end^T U0    (K_end = K * exp(G_C - G))
so the only sequential work is one [dk, dk] x [dk, dv] product per chunk.

Packed THD tokens are laid out chunk by chunk, every sequence padded to whole chunks (padding rows are zero: k = 0,
beta = 0, g = 0, which leave the state unchanged), so no chunk holds two sequences; the chunk recurrence runs over
[sequences, chunks], each sequence from a zero state, so nothing crosses a sequence boundary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slime.accelerator.ops.reference import compute_dtype, seqlens_to_host

__all__ = ["kda", "causal_conv1d", "kda_gate"]

CHUNK = 64
L2_EPS = 1e-6  # fla / transformers' l2norm: x / sqrt(sum x^2 + eps)
ACTIVATIONS = (None, "silu", "swish")


@dataclass(frozen=True)
class ChunkLayout:
    """Where each packed token sits when every sequence is padded to whole chunks, and which chunk each
    (sequence, step) of the chunk recurrence reads."""

    gather: torch.Tensor  # [chunks * CHUNK] row of the packed tensor for each chunk slot; `tokens` = a zero row
    slot_of_token: torch.Tensor  # [tokens] the chunk slot of each packed token
    chunk_grid: torch.Tensor  # [sequences, max chunks] chunk id at each step; `chunks` = an empty chunk
    grid_used: torch.Tensor  # [sequences, max chunks] bool: the step holds a real chunk
    chunks: int

    @classmethod
    def build(cls, lengths: list[int], chunk: int, device: torch.device) -> "ChunkLayout":
        lens = torch.tensor(lengths, dtype=torch.long)
        per_seq = (lens + chunk - 1) // chunk
        chunks = int(per_seq.sum())
        tokens = int(lens.sum())
        first_chunk = per_seq.cumsum(0) - per_seq
        starts = lens.cumsum(0) - lens
        slot = torch.arange(tokens) + torch.repeat_interleave(first_chunk * chunk - starts, lens)
        gather = torch.full((chunks * chunk,), tokens, dtype=torch.long)
        gather[slot] = torch.arange(tokens)
        steps = int(per_seq.max()) if len(lengths) else 0
        used = torch.arange(steps)[None, :] < per_seq[:, None]
        grid = torch.full(used.shape, chunks, dtype=torch.long)
        grid[used] = torch.arange(chunks)
        return cls(gather.to(device), slot.to(device), grid.to(device), used.to(device), chunks)

    def to_chunks(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """[T, H, *] packed -> [chunks, H, chunk, *]."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.gather]
        return padded.view(self.chunks, chunk, *x.shape[1:]).transpose(1, 2).contiguous()

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[chunks, H, chunk, D] -> [T, H, D]."""
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[self.slot_of_token]

    def on_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[chunks, ...] -> [sequences, max chunks, ...] (zeros at the unused steps)."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.chunk_grid]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def check_kda_shapes(q, k, v, g, beta) -> None:
    if k.dim() != 3 or q.shape != k.shape or g.shape != k.shape:
        raise ValueError(f"kda: q, k and g must be [T, H, Dk] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(g.shape)}")
    if v.dim() != 3 or v.shape[:2] != k.shape[:2] or tuple(beta.shape) != tuple(k.shape[:2]):
        raise ValueError(f"kda: v must be [T, H, Dv] and beta [T, H] for k {tuple(k.shape)}, got {tuple(v.shape)} and "
                         f"{tuple(beta.shape)}")


@functools.lru_cache(maxsize=8)
def _pair_order(chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Flat positions (row * chunk + col) of the j < i pairs in the order _pairs_by_level emits them, and for every
    position of the [chunk, chunk] matrix the slot of its value in [pairs..., diagonal..., zero]."""
    order = []
    half = chunk // 2
    while half:
        for m in range(chunk // (2 * half)):
            for r in range(half):
                order.extend(((2 * m + 1) * half + r) * chunk + 2 * m * half + c for c in range(half))
        half //= 2
    slot = [len(order) + chunk] * (chunk * chunk)  # the zero slot
    for i, pos in enumerate(order):
        slot[pos] = i
    for i in range(chunk):
        slot[i * chunk + i] = len(order) + i
    return tuple(order), tuple(slot)


def _pairs_by_level(q, k_beta, k, decay):
    """A (strictly lower, beta_i folded in) and P (lower with the diagonal), both [..., C, C], from q, k_beta,
    k and decay = G [..., C, dk]. The chunk is halved recursively: at each level every pair of sibling blocks
    (i in the later one, j in the earlier) goes through one matmul, pivoting on the later block's first token."""
    chunk, dk = k.shape[-2], k.shape[-1]
    a_parts, p_parts = [], []
    half = chunk // 2
    while half:
        def split(t, half=half):  # [..., C, dk] -> [..., sibling pairs, 2, half, dk]
            return t.reshape(*t.shape[:-2], chunk // (2 * half), 2, half, dk)

        g = split(decay)
        pivot = g[..., 1, :1, :]
        to_pivot = (g[..., 1, :, :] - pivot).exp()
        earlier = split(k)[..., 0, :, :] * (pivot - g[..., 0, :, :]).exp()
        later = torch.cat([split(k_beta)[..., 1, :, :] * to_pivot, split(q)[..., 1, :, :] * to_pivot], dim=-2)
        product = later @ earlier.transpose(-1, -2)  # [..., pairs, 2 * half, half]
        a_parts.append(product[..., :half, :].flatten(-3))
        p_parts.append(product[..., half:, :].flatten(-3))
        half //= 2
    _, slot = _pair_order(chunk)
    slot = torch.tensor(slot, device=k.device)
    zero = k.new_zeros(*k.shape[:-2], 1)
    a_parts.extend([k.new_zeros(*k.shape[:-2], chunk), zero])
    p_parts.extend([(q * k).sum(-1), zero])
    a = torch.cat(a_parts, dim=-1).index_select(-1, slot).unflatten(-1, (chunk, chunk))
    p = torch.cat(p_parts, dim=-1).index_select(-1, slot).unflatten(-1, (chunk, chunk))
    return a, p


def _chunk_terms(q, k, v, g, beta):
    """Per chunk ([..., C, *]): P U0 [C, dv], M [C, dk], the state's transition [dk, dk] and input [dk, dv]."""
    decay = g.cumsum(-2)
    k_beta = k * beta[..., None]
    system, scores = _pairs_by_level(q, k_beta, k, decay)
    rhs = torch.cat([v * beta[..., None], k_beta * decay.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # U = U0 - W S0
    last = decay[..., -1:, :]
    k_end = k * (last - decay).exp()
    k_end_t = k_end.transpose(-1, -2)
    transition = torch.diag_embed(last.squeeze(-2).exp()) - k_end_t @ w
    return scores @ u0, q * decay.exp() - scores @ w, transition, k_end_t @ u0


def _states_before_chunks(layout: ChunkLayout, transition, state_input):
    """The state entering every chunk, [chunks, H, dk, dv]: the chunk recurrence per sequence from zero."""
    grid_input = layout.on_grid(state_input)
    if not grid_input.shape[1]:
        return state_input.new_zeros(0, *state_input.shape[1:])
    state = grid_input.new_zeros(grid_input.shape[0], *grid_input.shape[2:])
    before = []
    # unbind, not [:, step]: the backward of one unbind stacks the step grads once; a select per step would
    # allocate a zero tensor of the whole grid for every step.
    for transition_c, input_c in zip(layout.on_grid(transition).unbind(1), grid_input.unbind(1)):
        before.append(state)
        state = torch.baddbmm(input_c.flatten(0, 1), transition_c.flatten(0, 1), state.flatten(0, 1)).view_as(state)
    return torch.stack(before, dim=1)[layout.grid_used]


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        cu_seqlens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Chunked KDA over packed sequences. q, k [T, H, Dk] (raw: L2-normalised here, eps 1e-6), v [T, H, Dv],
    g [T, H, Dk] per-channel log-decay (<= 0), beta [T, H], cu_seqlens int32 [N+1]; the state starts at zero in
    every sequence. scale: default Dk^-0.5. Returns [T, H, Dv] in v's dtype (computed in float32, or float64)."""
    check_kda_shapes(q, k, v, g, beta)
    offsets = seqlens_to_host(cu_seqlens, k.shape[0])
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    dtype = compute_dtype(v.dtype)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[0] == 0:
        return v.new_zeros(v.shape)
    layout = ChunkLayout.build(lengths, CHUNK, k.device)
    qn = l2_normalize(q.to(dtype)) * scale
    kn = l2_normalize(k.to(dtype))
    qc, kc, vc, gc = (layout.to_chunks(t, CHUNK) for t in (qn, kn, v.to(dtype), g.to(dtype)))
    bc = layout.to_chunks(beta.to(dtype)[..., None], CHUNK)[..., 0]
    intra, state_read, transition, state_input = _chunk_terms(qc, kc, vc, gc, bc)
    states = _states_before_chunks(layout, transition, state_input)
    return layout.to_tokens(intra + state_read @ states).to(v.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                  activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution within each packed sequence: x [T, C], weight [C, K] (tap K-1 on the current
    token), then `activation` ("silu"/"swish" or None). Computed in float32 (float64 stays), returned in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d: x must be [T, C] and weight [C, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    lengths = torch.tensor(seqlens_to_host(cu_seqlens, x.shape[0]), dtype=torch.long).diff()
    dtype = torch.promote_types(compute_dtype(x.dtype), compute_dtype(weight.dtype))
    position = torch.arange(x.shape[0]) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    position = position.to(x.device)[:, None]
    xf, w = x.to(dtype), weight.to(dtype)
    taps = w.shape[1]
    out = xf * w[:, taps - 1]
    for shift in range(1, min(taps, x.shape[0] + 1)):
        earlier = F.pad(xf, (0, 0, shift, 0))[: x.shape[0]]
        out = out + earlier * (position >= shift).to(dtype) * w[:, taps - 1 - shift]
    return (out if activation is None else F.silu(out)).to(x.dtype)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,  # noqa: N803 (the checkpoint's name)
             lower_bound: float | None) -> torch.Tensor:
    """KDA's per-channel log-decay from f = f_b_proj(f_a_proj(x)) [T, H, D]: with x = f + dt_bias,
    lower_bound * sigmoid(exp(A_log) x) when a lower bound is set, else -exp(A_log) softplus(x) (softplus = x above
    20). Float32 (float64 stays), [T, H, D]."""
    heads, dim = f.shape[-2:]
    if A_log.numel() != heads or dt_bias.numel() != heads * dim:
        raise ValueError(f"kda_gate: A_log must have H={heads} and dt_bias H*D={heads * dim} values, got "
                         f"{A_log.numel()} and {dt_bias.numel()}")
    dtype = compute_dtype(f.dtype)
    x = f.to(dtype) + dt_bias.to(dtype).view(heads, dim)
    rate = A_log.to(dtype).exp().view(heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x, beta=1.0, threshold=20.0)
