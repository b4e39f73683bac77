"""The reference attention of long sequences in blocks of query rows, never holding a sequence's whole
[heads, queries, keys] score matrix (slime/accelerator/ops/reference.py's `attention` and `sparse_attention`
switch to it above SCORE_ELEMENTS_LIMIT).

The dense path materialises float32 scores and probabilities per sequence and autograd keeps them for backward:
about 3.4 GB per layer for one 10k-token sample at 8 heads. Here each block of query rows is scored against its
visible keys only (causal: up to the block's last row), softmax-normalised (a row's softmax needs only its own
scores, so blocking over rows is exact without an online rescaling), and multiplied into the output; nothing
of the block is kept. Backward recomputes each block's probabilities from q, k and v (flash-attention's
recomputation) and accumulates dk, dv over the blocks. Peak extra memory: a few blocks of at most
BLOCK_ELEMENTS scores. Same contract and masking rules as the dense path (bottom-right causal alignment, DSA
selections by position within the sequence, -1 / future positions ignored, rows without a key give 0).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_ELEMENTS", "SCORE_ELEMENTS_LIMIT", "blocked_attention", "needs_blocks"]

# Above this many scores per sequence ([heads, queries, keys]) the reference works in blocks of query rows.
SCORE_ELEMENTS_LIMIT = 1 << 25  # 128 MB of float32 scores
BLOCK_ELEMENTS = 1 << 20  # scores of one block (4 MB in float32)


def needs_blocks(cq: list[int], ck: list[int], heads: int) -> bool:
    """Whether some sequence of the pack would have more than SCORE_ELEMENTS_LIMIT scores."""
    return any(heads * (cq[b + 1] - cq[b]) * (ck[b + 1] - ck[b]) > SCORE_ELEMENTS_LIMIT for b in range(len(cq) - 1))


def _allowed(rows: slice, keys: int, sq: int, sk: int, causal: bool, topk: torch.Tensor | None, device):
    """[rows, keys] bool: which of the first `keys` keys each query row of the block may attend to, or None
    (every one)."""
    allowed = None
    if topk is not None:
        idx = topk[rows].long()
        selected = torch.zeros(idx.shape[0], keys + 1, dtype=torch.bool, device=device)
        selected.scatter_(1, torch.where((idx < 0) | (idx >= keys), keys, idx), True)  # -1 / beyond: a spare column
        allowed = selected[:, :keys]
    if causal:
        position = torch.arange(rows.start, rows.stop, device=device) + (sk - sq)
        visible = torch.arange(keys, device=device)[None, :] <= position[:, None]
        allowed = visible if allowed is None else allowed & visible
    return allowed


def _block_probs(qb, k, allowed, scale):
    """qb [r, G, R, D] (R query heads per key head), k [n, G, D] -> softmax probabilities [G, R, r, n]; rows
    without an allowed key are 0."""
    scores = torch.einsum("qgrd,kgd->grqk", qb, k) * scale
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    empty = ~allowed.any(-1, keepdim=True)
    return probs.masked_fill(empty, 0.0) if bool(empty.any()) else probs


class _BlockedAttention(torch.autograd.Function):
    """One sequence: q [sq, Hq, D], k [sk, Hkv, D], v [sk, Hkv, Dv] in the compute dtype -> [sq, Hq, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, topk, scale: float, causal: bool, block_rows: int):
        ctx.save_for_backward(q, k, v, topk)
        ctx.scale, ctx.causal, ctx.block_rows = scale, causal, block_rows
        sq, hq, _ = q.shape
        sk, hkv, dv = v.shape
        out = q.new_zeros(sq, hq, dv)
        for rows, keys in _blocks(sq, sk, causal, block_rows):
            qb = q[rows].reshape(-1, hkv, hq // hkv, q.shape[-1])
            probs = _block_probs(qb, k[:keys], _allowed(rows, keys, sq, sk, causal, topk, q.device), scale)
            out[rows] = torch.einsum("grqk,kgd->qgrd", probs, v[:keys]).reshape(-1, hq, dv)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, topk = ctx.saved_tensors
        scale, causal = ctx.scale, ctx.causal
        sq, hq, d = q.shape
        sk, hkv, dv = v.shape
        dq, dk, dv_ = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad_out = grad_out.to(q.dtype)
        for rows, keys in _blocks(sq, sk, causal, ctx.block_rows):
            qb = q[rows].reshape(-1, hkv, hq // hkv, d)
            gb = grad_out[rows].reshape(-1, hkv, hq // hkv, dv)
            probs = _block_probs(qb, k[:keys], _allowed(rows, keys, sq, sk, causal, topk, q.device), scale)
            dv_[:keys] += torch.einsum("grqk,qgrd->kgd", probs, gb)
            dprobs = torch.einsum("qgrd,kgd->grqk", gb, v[:keys])
            dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
            dq[rows] = (torch.einsum("grqk,kgd->qgrd", dscores, k[:keys]) * scale).reshape(-1, hq, d)
            dk[:keys] += torch.einsum("grqk,qgrd->kgd", dscores, qb) * scale
        return dq, dk, dv_, None, None, None, None


def _blocks(sq: int, sk: int, causal: bool, block_rows: int):
    """(row slice, visible key count) of each block of query rows."""
    for start in range(0, sq, block_rows):
        stop = min(sq, start + block_rows)
        keys = min(sk, stop + sk - sq) if causal else sk
        yield slice(start, stop), max(keys, 0)


def blocked_attention(q, k, v, cq: list[int], ck: list[int], causal: bool, scale: float,
                      topk: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` (topk None) / `sparse_attention` over a validated pack (host offsets cq, ck), by blocks of
    query rows; GQA as there (query head h uses key/value head h // (Hq // Hkv))."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq = q.shape[1]
    outs = []
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0:
            continue
        if sk == 0:  # no key: zeros, as the dense path
            outs.append(q.new_zeros(sq, hq, v.shape[2]))
            continue
        sel = None if topk is None else topk[cq[b] : cq[b + 1]]
        if sel is not None and (bool((sel < -1).any()) or (not causal and bool((sel >= sk).any()))):
            raise ValueError(f"topk_indices of sequence {b} must be in [-1, {sk}) (positions within the sequence)")
        block_rows = max(1, BLOCK_ELEMENTS // (hq * sk))
        out = _BlockedAttention.apply(q[cq[b] : cq[b + 1]].to(ct), k[ck[b] : ck[b + 1]].to(ct),
                                      v[ck[b] : ck[b + 1]].to(ct), sel, float(scale), bool(causal), block_rows)
        outs.append(out.to(q.dtype))
    if not outs:
        return q.new_zeros(0, hq, v.shape[2])
    return torch.cat(outs, dim=0)
