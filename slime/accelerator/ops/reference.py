"""Reference op implementations: pure torch, runnable on every device, the source of truth.

Every device implementation (slime/accelerator/ops/cuda.py, slime/accelerator/ascend/ops.py) takes
exactly these signatures and is tested against these functions.

Layout ("THD", packed): the tokens of all sequences are concatenated along dim 0. Sequence b owns
rows `cu_seqlens[b]:cu_seqlens[b+1]`; `cu_seqlens` is int32 with a leading 0 (flash-attn convention).
Zero-length sequences inside a pack are allowed. Low-precision inputs are computed in float32 and
cast back; float64 inputs stay float64 (the tests use that as the exact reference).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from slime.accelerator.ops.blocked_attention import blocked_attention, needs_blocks

__all__ = [
    "rms_norm", "apply_rotary", "attention", "sparse_attention", "lightning_indexer", "swiglu",
    "moe_route", "moe_permute", "moe_unpermute", "grouped_matmul", "token_log_probs",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def seqlens_to_host(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate a cumulative-length tensor (int32, leading 0, non-decreasing, ends at `total`); host list."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__)
        raise TypeError(f"{name} must be a 1-D int32 tensor of cumulative offsets with a leading 0, got {got}")
    host = [int(v) for v in cu_seqlens.tolist()]
    if not host or host[0] != 0:
        raise ValueError(f"{name} must start with 0 (e.g. [0, 3, 7]), got {host[:4]}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {host}")
    if host[-1] != total:
        raise ValueError(f"{name} ends at {host[-1]} but the packed tensor has {total} tokens")
    return host


# --- normalisation / activation -------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2, -1) + eps))`, normalised in float32 and cast back to x.dtype before
    the weight multiply (transformers' GlmMoeDsaRMSNorm order). Output dtype: promote(x, weight)."""
    xf = x.to(compute_dtype(x.dtype))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` with n = x.shape[-1] // 2 (gate first, as transformers' gate_up_proj)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim (gate and up halves), got {x.shape[-1]}")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- rotary ---------------------------------------------------------------------------------


def rotary_pair_angles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
    """cos/sin -> per-pair tensors of width rotary_dim // 2 that broadcast against x[..., :rotary_dim // 2].

    Accepted cos/sin widths: `rotary_dim` (transformers layout `cat(freqs, freqs)`) or `rotary_dim // 2`
    (one angle per rotated pair). Shapes `[T, w]` (one row per token, broadcast over heads) or anything
    that broadcasts to x[..., :w].
    """
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    half = rotary_dim // 2
    width = cos.shape[-1]
    if width == rotary_dim and rotary_dim != half:
        cos, sin = cos[..., :half], sin[..., :half]
    elif width != half:
        raise ValueError(
            f"cos/sin last dim must be rotary_dim={rotary_dim} (cat(freqs, freqs)) or rotary_dim//2={half}, got {width}"
        )
    if cos.dim() == x.dim() - 1:  # [T, w] against [T, H, D]: broadcast over heads
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return cos, sin


def check_rotary_dim(x: torch.Tensor, rotary_dim: int | None) -> int:
    d = x.shape[-1]
    rd = d if rotary_dim is None else int(rotary_dim)
    if rd <= 0 or rd > d or rd % 2:
        raise ValueError(f"rotary_dim must be even and in (0, {d}], got {rotary_dim}")
    return rd


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first `rotary_dim` features of the last dim of x (e.g. `[T, H, D]`); the rest pass through.

    interleaved=False: NeoX "half" pairs (i, i + rotary_dim/2), i.e. `x*cos + rotate_half(x)*sin`.
    interleaved=True: GPT-J pairs (2i, 2i+1), output stays interleaved. transformers'
    `apply_rotary_pos_emb_interleave` (GLM-5) returns the same rotation with the pairs de-interleaved
    (`cat(even, odd)`); applied to both q and k that is a fixed permutation, so q.k is identical.
    """
    rd = check_rotary_dim(x, rotary_dim)
    cos, sin = rotary_pair_angles(x, cos, sin, rd)
    ct = compute_dtype(x.dtype)
    c, s = cos.to(ct), sin.to(ct)
    xr = x[..., :rd].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    if rd == x.shape[-1]:  # nothing passes through (MLA's rope slice): no copy into a concatenation
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


# --- attention ------------------------------------------------------------------------------


def packed_offsets(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """Host offsets (leading 0) of the query and key packs; both must hold the same number of sequences."""
    cq = seqlens_to_host(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    ck = seqlens_to_host(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} sequences, cu_seqlens_k {len(ck) - 1}")
    return cq, ck


def default_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    """The softmax scale: `softmax_scale`, else head_dim**-0.5."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """Validate THD q/k/v; returns (Hq, Hkv)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention takes packed THD tensors q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if v.shape[1] != hkv or v.shape[0] != k.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share tokens and heads")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return hq, hkv


def _masked_softmax_attention(qb, kb, vb, allowed, scale, out_dtype, empty_rows: bool = True):
    """qb [..., Sq, Hq, D], kb/vb [..., Sk, Hkv, *] (one sequence, or several of one length stacked in front),
    allowed bool broadcasting to the scores [..., Hq, Sq, Sk] or None. Rows with no allowed key give 0
    (flash-attn convention); empty_rows=False: the caller knows every row has one (skips that check)."""
    ct = compute_dtype(qb.dtype)
    rep = qb.shape[-2] // kb.shape[-2]
    kb, vb = kb.to(ct), vb.to(ct)
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, dim=-2), vb.repeat_interleave(rep, dim=-2)
    scores = torch.einsum("...qhd,...khd->...hqk", qb.to(ct), kb) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(ct).min)
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None and empty_rows:
        empty = ~allowed.any(-1, keepdim=True)
        if bool(empty.any()):  # host check: most masks leave every row a key, and the fill costs fwd + bwd
            probs = probs.masked_fill(empty, 0.0)
    return torch.einsum("...hqk,...khd->...qhd", probs, vb).to(out_dtype)


@functools.lru_cache(maxsize=32)
def _cached_causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask (True = may attend): query i sees keys j <= i + sk - sq. Cached per
    (sq, sk, device) and shared by every layer and step: callers must not modify it in place."""
    return _cached_causal_mask(int(sq), int(sk), torch.device(device))


def uniform_segments(cq: list[int], ck: list[int]) -> tuple[int, int, int] | None:
    """(n, sq, sk) when the query segments all have sq rows and the key segments sk (a [B, S] batch), so
    the sequences can be computed as one stacked batch; None otherwise (or for a single sequence)."""
    n = len(cq) - 1
    if n < 2:
        return None
    sq, sk = cq[1] - cq[0], ck[1] - ck[0]
    if sq == 0 or sk == 0 or cq[-1] != n * sq or ck[-1] != n * sk:
        return None
    if any(cq[i] != i * sq for i in range(n + 1)) or any(ck[i] != i * sk for i in range(n + 1)):
        return None
    return n, sq, sk


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Variable-length softmax attention on packed sequences.

    q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]. GQA: query head h uses key/value
    head h // (Hq // Hkv). Default scale Dqk**-0.5. causal is bottom-right aligned when a sequence has
    more keys than queries (flash-attn). Query rows without any visible key return 0.

    Queries that are a part of their sequence (context parallel, decode): segment b's queries are the
    LAST sq of its sk key positions, so query i sees keys j <= i + sk - sq. A CP rank passes each of its
    chunks as one query segment and, as its key segment, the sequence from its start to the chunk's end
    (slime_plugins/models/common/context_parallel.py): each query then sees exactly its causal prefix, and
    key positions count from the sequence start (what DSA top-k indices refer to).
    """
    check_attention_shapes(q, k, v)
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    scale = default_scale(q, softmax_scale)
    if needs_blocks(cq, ck, q.shape[1]):  # long sequences: no whole [heads, queries, keys] score matrix
        return blocked_attention(q, k, v, cq, ck, causal, scale)
    uniform = uniform_segments(cq, ck)
    if uniform is not None:  # equal-length sequences: one stacked computation, the same math per sequence
        n, sq, sk = uniform
        allowed = causal_mask(sq, sk, q.device) if causal else None
        out = _masked_softmax_attention(q.reshape(n, sq, *q.shape[1:]), k.reshape(n, sk, *k.shape[1:]),
                                        v.reshape(n, sk, *v.shape[1:]), allowed, scale, q.dtype, empty_rows=sk < sq)
        return out.reshape(q.shape[0], q.shape[1], v.shape[2])
    outs = []
    for b in range(len(cq) - 1):
        qb, kb, vb = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        if qb.shape[0] == 0:
            continue
        sq, sk = qb.shape[0], kb.shape[0]
        allowed = causal_mask(sq, sk, q.device) if causal else None  # without causal every row sees every key
        outs.append(_masked_softmax_attention(qb, kb, vb, allowed, scale, q.dtype, empty_rows=sk < sq or sk == 0))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.cat(outs, dim=0)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """DSA sparse attention: `attention`, but query t only sees the keys listed in topk_indices[t].

    topk_indices [Tq, topk] int (the `lightning_indexer` output): key positions *within the query's own
    sequence* (0 = first key of that sequence), -1 = unused slot. A listed key is still subject to the
    causal mask (transformers combines the DSA index mask with the causal mask the same way); with causal,
    a position past the end of the query segment's keys is a future key and is ignored (context parallel:
    a chunk's keys end where the chunk ends, see `attention`).
    Shapes and scale as in `attention` (MLA: Dqk 192+64, Dv 256). No gradient flows to topk_indices.
    """
    check_attention_shapes(q, k, v)
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    if topk_indices.dim() != 2 or topk_indices.shape[0] != q.shape[0]:
        raise ValueError(f"topk_indices must be [Tq={q.shape[0]}, topk], got {tuple(topk_indices.shape)}")
    scale = default_scale(q, softmax_scale)
    if needs_blocks(cq, ck, q.shape[1]):  # long sequences: no whole [heads, queries, keys] score matrix
        return blocked_attention(q, k, v, cq, ck, causal, scale, topk_indices)
    uniform = uniform_segments(cq, ck)
    if uniform is not None:  # equal-length sequences: one stacked computation, the same math per sequence
        n, sq, sk = uniform
        idx = topk_indices.long().reshape(n, sq, -1)
        if bool((idx < -1).any()) or (not causal and bool((idx >= sk).any())):
            raise ValueError(f"topk_indices must be in [-1, {sk}) (positions within each sequence)")
        selected = torch.zeros(n, sq, sk + 1, dtype=torch.bool, device=q.device)
        selected.scatter_(2, torch.where((idx < 0) | (idx >= sk), sk, idx), True)  # -1 / future: a spare column
        allowed = selected[..., :sk]
        if causal:
            allowed = allowed & causal_mask(sq, sk, q.device)
        out = _masked_softmax_attention(q.reshape(n, sq, *q.shape[1:]), k.reshape(n, sk, *k.shape[1:]),
                                        v.reshape(n, sk, *v.shape[1:]), allowed[:, None], scale, q.dtype)
        return out.reshape(q.shape[0], q.shape[1], v.shape[2])
    outs = []
    for b in range(len(cq) - 1):
        qb, kb, vb = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        sq, sk = qb.shape[0], kb.shape[0]
        if sq == 0:
            continue
        idx = topk_indices[cq[b] : cq[b + 1]].long()
        if bool((idx < -1).any()) or (not causal and bool((idx >= sk).any())):
            raise ValueError(f"topk_indices of sequence {b} must be in [-1, {sk}) (positions within the sequence)")
        selected = torch.zeros(sq, sk + 1, dtype=torch.bool, device=q.device)
        selected.scatter_(1, torch.where((idx < 0) | (idx >= sk), sk, idx), True)  # -1 / future: a spare column
        allowed = selected[:, :sk]
        if causal:
            allowed = allowed & causal_mask(sq, sk, q.device)
        outs.append(_masked_softmax_attention(qb, kb, vb, allowed, scale, q.dtype))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.cat(outs, dim=0)


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk with one tie rule: among equal scores the lowest position wins, whatever the tensor's
    shape (torch.topk's tie order depends on shape and kernel: a one-row decode step and a full-sequence
    forward can keep different tied keys). Best first. A stable sort, so O(n log n) per row."""
    values, indices = torch.sort(scores, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def _indexer_head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [n, S, H, D], k [n, T, D] -> q . k for every (query, head, key): [n, S, H, T].

    The values of `torch.matmul(q, k.transpose(-1, -2).unsqueeze(1))` (transformers' GlmMoeDsaIndexer),
    computed as one [S*H, D] x [D, T] matmul per sequence: the broadcast form expands the keys to
    [n, S, D, T] (a copy S times the key tensor) and runs S tiny [H, D] x [D, T] matmuls. Each output is
    the same dot product over D; tests/test_dsa_fast_paths.py checks the two bitwise."""
    n, s, h, d = q.shape
    return torch.matmul(q.reshape(n, s * h, d), k.transpose(-1, -2)).view(n, s, h, k.shape[1])


@torch.no_grad()
def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """DSA lightning indexer (transformers `GlmMoeDsaIndexer`, after its projections and RoPE).

    q [Tq, H, D] (indexer query heads), k [Tk, D] or [Tk, 1, D] (one shared key head), weights [Tq, H]
    (per-head gates, the caller already multiplied by H**-0.5 as transformers does).
    score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s] * softmax_scale), default scale D**-0.5;
    causal positions masked. Returns int32 [Tq, topk]: for each query the key positions *within its
    sequence* with the highest scores, best first; among equal scores (e.g. several keys whose ReLU terms
    are all 0) the lowest position wins (`stable_topk`), so a decode step and a full forward keep the same
    keys (the embedded engine patches transformers' indexer to the same rule). -1 in the unused slots
    (fewer than topk visible keys). No gradient (transformers runs it in no_grad).
    Causal masking and query segments that are a part of their sequence (context parallel) as in
    `attention`: the returned positions count from the start of the query segment's keys.
    """
    if k.dim() == 3:
        if k.shape[1] != 1:
            raise ValueError(f"lightning_indexer takes one shared key head: k [Tk, D] or [Tk, 1, D], got {tuple(k.shape)}")
        k = k[:, 0]
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"lightning_indexer needs q [Tq, H, D] and k [Tk, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if weights.shape != q.shape[:2]:
        raise ValueError(f"weights must be [Tq, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    topk = int(topk)
    if topk <= 0:
        raise ValueError(f"topk must be positive, got {topk}")
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    scale = default_scale(q, softmax_scale)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    uniform = uniform_segments(cq, ck)
    if uniform is not None:  # equal-length sequences: one stacked computation, the same math per sequence
        n, sq, sk = uniform
        qb = q.reshape(n, sq, *q.shape[1:])  # [n, S, H, D]
        kb = k.reshape(n, sk, k.shape[-1])  # [n, T, D]
        scores = F.relu(_indexer_head_scores(qb.to(ct), kb.to(ct)) * scale)
        w = weights.reshape(n, sq, -1).to(ct)
        index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [n, S, T]
        if causal:
            index_scores = index_scores.masked_fill(~causal_mask(sq, sk, q.device), float("-inf"))
        kk = min(topk, sk)
        vals, idx = stable_topk(index_scores, kk)
        out.view(n, sq, topk)[..., :kk] = torch.where(torch.isinf(vals) & (vals < 0), -1, idx).to(torch.int32)
        return out
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0 or sk == 0:
            continue
        qb = q[cq[b] : cq[b + 1]].unsqueeze(0)  # [1, S, H, D], the transformers shapes and op order
        kb = k[ck[b] : ck[b + 1]].unsqueeze(0)  # [1, T, D]
        scores = _indexer_head_scores(qb.to(ct), kb.to(ct)) * scale
        scores = F.relu(scores)
        w = weights[cq[b] : cq[b + 1]].unsqueeze(0).to(ct)
        index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, T]
        if causal:
            index_scores = index_scores.masked_fill(~causal_mask(sq, sk, q.device), float("-inf"))
        kk = min(topk, sk)
        vals, idx = stable_topk(index_scores, kk)
        out[cq[b] : cq[b + 1], :kk] = torch.where(torch.isinf(vals) & (vals < 0), -1, idx).to(torch.int32)
    return out


# --- MoE ------------------------------------------------------------------------------------


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM/DeepSeek "noaux_tc" router on logits [T, E] -> (weights float32 [T, top_k], indices int64 [T, top_k]).

    scores = sigmoid(logits) in float32; experts chosen on scores + bias (bias only for the choice);
    group-limited: keep the topk_group groups whose top-2 choice scores sum highest; weights are the
    unbiased scores of the chosen experts, divided by (sum + 1e-20) when norm_topk_prob, times
    routed_scaling_factor. The same torch ops in the same order as transformers' GlmMoeDsaTopkRouter,
    so ties break identically. Gradient flows to logits through the weights.
    """
    if logits.dim() != 2:
        raise ValueError(f"moe_route takes router logits [T, E], got {tuple(logits.shape)}")
    e = logits.shape[1]
    if n_group <= 0 or e % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide E={e} and 0 < topk_group={topk_group} <= n_group")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in (0, {e}]")
    ct = compute_dtype(logits.dtype)
    scores = logits.to(ct).sigmoid()
    scores_for_choice = scores.detach() + (bias.to(ct) if bias is not None else 0.0)
    group_scores = scores_for_choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices


def moe_permute(tokens: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group token copies by expert: tokens [T, H], indices [T, K] expert ids ->
    (permuted [T*K, H] sorted by expert, within an expert in (token, k) order; sort_map int32 [T*K]).

    sort_map[t*K + k] is the row of `permuted` that holds token t's copy for its k-th expert
    (torch_npu's `sorted_indices` convention); pass it to `moe_unpermute`. Tokens per expert for
    `grouped_matmul`: `torch.bincount(indices.flatten(), minlength=E)`.
    """
    if indices.dim() == 1:
        indices = indices.unsqueeze(1)
    if tokens.dim() != 2 or indices.dim() != 2 or indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"moe_permute needs tokens [T, H] and indices [T, K]; got {tuple(tokens.shape)}, {tuple(indices.shape)}")
    order = torch.argsort(indices.reshape(-1), stable=True)  # permuted row j holds copy order[j]
    sort_map = torch.empty_like(order)
    sort_map[order] = torch.arange(order.numel(), device=order.device)
    return tokens.index_select(0, order // indices.shape[1]), sort_map.to(torch.int32)


def moe_unpermute(permuted: torch.Tensor, sort_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `moe_permute` with the weighted sum over each token's K copies:
    out[t] = sum_k weights[t, k] * permuted[sort_map[t*K + k]]. weights [T, K]; output [T, H] in
    permuted.dtype, accumulated in float32. Gradients flow to permuted and weights.
    """
    if weights.dim() == 1:
        weights = weights.unsqueeze(1)
    t, kk = weights.shape
    if permuted.dim() != 2 or permuted.shape[0] != t * kk or sort_map.numel() != t * kk:
        raise ValueError(
            f"moe_unpermute: permuted {tuple(permuted.shape)}, sort_map {tuple(sort_map.shape)} and weights "
            f"{tuple(weights.shape)} disagree (need permuted [T*K, H], sort_map [T*K], weights [T, K])"
        )
    ct = compute_dtype(permuted.dtype)
    # Explicit hidden size: with t == 0 (a rank that received no tokens) a -1 dim would be ambiguous.
    copies = permuted.index_select(0, sort_map.reshape(-1).long()).view(t, kk, permuted.shape[1]).to(ct)
    return (copies * weights.to(ct).unsqueeze(-1)).sum(dim=1).to(permuted.dtype)


def tokens_per_expert_to_host(tokens_per_expert: torch.Tensor, num_experts: int, total: int) -> list[int]:
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if len(counts) != num_experts or any(c < 0 for c in counts) or sum(counts) != total:
        raise ValueError(
            f"tokens_per_expert must be {num_experts} non-negative counts summing to {total} rows of x, "
            f"got {counts[:8]}{'...' if len(counts) > 8 else ''} (sum {sum(counts)})"
        )
    return counts


def check_grouped_matmul(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul needs x [T, K] and w [E, K, N]; got {tuple(x.shape)}, {tuple(w.shape)}")


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Per-expert matmul on expert-sorted rows: x [T, K], w [E, K, N], tokens_per_expert [E] counts
    (sum == T; zero allowed) -> [T, N], rows of expert e multiplied by w[e]. Backward gives dx and dw."""
    check_grouped_matmul(x, w)
    counts = tokens_per_expert_to_host(tokens_per_expert, w.shape[0], x.shape[0])
    # unbind, not w[e]: its backward stacks the experts' grads into one [E, K, N] tensor (w[e]'s would
    # allocate and zero a full-size grad per expert, then sum them).
    experts = w.unbind(0)
    outs = [xe @ experts[e] for e, xe in enumerate(x.split(counts)) if counts[e]]
    if not outs:
        return (x[:0] @ w[0]) if w.shape[0] else x.new_zeros(0, w.shape[2])
    return torch.cat(outs, dim=0)


# --- log-probs ------------------------------------------------------------------------------

# Work buffer per chunk of token_log_probs: rows * vocab elements.
TOKEN_LOG_PROBS_CHUNK_ELEMENTS = 1 << 24


class _TokenLogProbs(torch.autograd.Function):
    """Chunked log-softmax gather + entropy; saves only the logits and per-row statistics, so the
    [T, V] float32 softmax never exists at once (forward or backward)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, chunk: int):
        ct = compute_dtype(logits.dtype)
        n = logits.shape[0]
        log_probs = torch.empty(n, dtype=ct, device=logits.device)
        entropy = torch.empty(n, dtype=ct, device=logits.device)
        lse = torch.empty(n, dtype=ct, device=logits.device)
        for s in range(0, n, chunk):
            z = logits[s : s + chunk].to(ct)
            lse_c = torch.logsumexp(z, dim=-1)
            logp = z - lse_c.unsqueeze(-1)
            entropy[s : s + chunk] = -(logp.exp() * logp).sum(-1)
            log_probs[s : s + chunk] = logp.gather(1, tokens[s : s + chunk].unsqueeze(1)).squeeze(1)
            lse[s : s + chunk] = lse_c
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.chunk = chunk
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, tokens, lse, entropy = ctx.saved_tensors
        ct = lse.dtype
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            logp = logits[s:e].to(ct) - lse[s:e].unsqueeze(-1)
            p = logp.exp()
            # d entropy / dz = -p * (log p + H);  d log p[y] / dz = onehot(y) - p
            g = (-g_ent[s:e].unsqueeze(-1)) * p * (logp + entropy[s:e].unsqueeze(-1))
            g = g - g_logp[s:e].unsqueeze(-1) * p
            g.scatter_add_(1, tokens[s:e].unsqueeze(1), g_logp[s:e].unsqueeze(1))
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None


def token_chunk_rows(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if int(chunk_size) <= 0:
            raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
        return int(chunk_size)
    return max(1, TOKEN_LOG_PROBS_CHUNK_ELEMENTS // max(1, vocab))


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], tokens [...] -> (log_softmax(logits)[tokens], entropy of softmax(logits)), both
    shaped like tokens, float32 (float64 for float64 logits). Processed `chunk_size` rows at a time
    (default: ~16M elements per chunk) with a custom backward that recomputes the softmax per chunk."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens must be int64/int32 token ids, got {tokens.dtype}")
    vocab = logits.shape[-1]
    flat_tokens = tokens.reshape(-1).long()
    if flat_tokens.numel() and bool(((flat_tokens < 0) | (flat_tokens >= vocab)).any()):
        raise ValueError(f"token ids must be in [0, {vocab}) (the logits' vocab); mask padding before calling")
    flat = logits.reshape(-1, vocab)
    chunk = token_chunk_rows(vocab, chunk_size)
    lp, ent = _TokenLogProbs.apply(flat, flat_tokens, chunk)
    return lp.view(tokens.shape), ent.view(tokens.shape)
