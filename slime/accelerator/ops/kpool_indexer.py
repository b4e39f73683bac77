"""Reference of the `kpool_indexer` op: GLM-5.3-Flash's (glm5_next) lightning indexer over k-pool compressed keys.

transformers' `Glm5NextTextIndexer`, after its projections: the keys of each sequence are grouped into pools of
`kpool` tokens starting at the sequence's first token; a pool's key is the per-channel softmax-weighted sum of its
tokens' keys, the softmax over the pool's tokens of `gate + ape` (gate = the token's `index_kpool_compress_gate`
score, ape = `index_kpool_compress_ape[position in the pool]`). Only complete pools exist; a pool is a candidate
for a query when its last token is visible (causal). Each query scores the candidates like the GLM-5 indexer
(sum over heads of weight * relu(q . pool_key * scale)), keeps the best `topk // kpool` pools and expands them
back to their token positions; with `always_select_tail` the query's visible incomplete pool (its last
`(position + 1) % kpool` tokens) follows them. The rest of each row is -1.

Packed THD layout and query/key segments as `lightning_indexer` (slime/accelerator/ops/reference.py): key
positions count from the start of each key segment, which is the sequence's start (context parallel: a rank's
chunk is a query segment whose key segment is its sequence up to the chunk's end, so pools line up with the
sequence's). The output is what `sparse_attention` takes. No gradient (transformers runs it under no_grad).
A module of its own: reference.py holds the ops shared by every family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime.accelerator.ops.reference import default_scale, packed_offsets, stable_topk

__all__ = ["kpool_indexer", "output_width"]

# Query rows scored at once: bounds the [rows, heads, pools] score block of long sequences (8k tokens, 32 heads,
# 512 pools: 512 MB in float32 when scored at once).
_SCORE_BLOCK_ELEMENTS = 1 << 22


def output_width(topk: int, kpool: int, always_select_tail: bool) -> int:
    """Columns of the op's output: topk // kpool pools of kpool tokens, plus up to kpool - 1 tail tokens."""
    return int(topk) + (int(kpool) - 1 if always_select_tail else 0)


def _check(q, k, gate, ape, weights, topk: int, kpool: int) -> torch.Tensor:
    if k.dim() == 3:
        if k.shape[1] != 1:
            raise ValueError(f"kpool_indexer takes one shared key head: k [Tk, D] or [Tk, 1, D], got {tuple(k.shape)}")
        k = k[:, 0]
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"kpool_indexer needs q [Tq, H, D] and k [Tk, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if gate.shape != k.shape:
        raise ValueError(f"gate (each key's compress-gate scores) must be [Tk, D] = {tuple(k.shape)}, got {tuple(gate.shape)}")
    if kpool < 1 or ape.shape != (kpool, k.shape[-1]):
        raise ValueError(f"ape must be [kpool, D] = ({kpool}, {k.shape[-1]}) with kpool >= 1, got {tuple(ape.shape)}")
    if weights.shape != q.shape[:2]:
        raise ValueError(f"weights must be [Tq, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    if topk < kpool or topk % kpool:
        raise ValueError(f"topk ({topk}) must be a positive multiple of kpool ({kpool}) (transformers' index_topk rule)")
    return k


def _pool_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, kpool: int, ct: torch.dtype) -> torch.Tensor:
    """Keys [sk, D] of one sequence -> the keys of its complete pools [sk // kpool, D] in `ct`. The softmax runs
    in `ct`, the weighted sum in the keys' dtype (transformers' order: bf16 pool keys in a bf16 model)."""
    pools = k.shape[0] // kpool
    grouped = k[: pools * kpool].view(pools, kpool, -1)
    logits = gate[: pools * kpool].view(pools, kpool, -1).to(ct) + ape.to(ct)
    return (logits.softmax(dim=1).to(k.dtype) * grouped).sum(dim=1).to(ct)


def _sequence(q, k, gate, ape, weights, out, topk: int, kpool: int, tail: bool, scale: float) -> None:
    """One query segment q [sq, H, D] against its key segment k [sk, D] (the queries are its last sq
    positions); writes the selected positions into out [sq, width]."""
    sq, heads, dim = q.shape
    sk = k.shape[0]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    position = torch.arange(sk - sq, sk, device=q.device)  # of each query within its sequence
    pools = sk // kpool
    keep = min(topk // kpool, pools)
    if keep:
        pool_keys = _pool_keys(k, gate, ape, kpool, ct)  # [P, D]
        pool_end = torch.arange(1, pools + 1, device=q.device) * kpool - 1
        offsets = torch.arange(kpool, device=q.device)
        rows = max(1, _SCORE_BLOCK_ELEMENTS // (heads * pools))
        for start in range(0, sq, rows):
            stop = min(sq, start + rows)
            scores = F.relu(torch.matmul(q[start:stop].reshape(-1, dim).to(ct), pool_keys.t()) * scale)
            scores = scores.view(stop - start, heads, pools)
            index_scores = torch.matmul(weights[start:stop].to(ct).unsqueeze(-2), scores).squeeze(-2)  # [rows, P]
            visible = pool_end[None, :] <= position[start:stop, None]
            vals, chosen = stable_topk(index_scores.masked_fill(~visible, float("-inf")), keep)
            tokens = chosen[..., None] * kpool + offsets  # [rows, keep, kpool]
            tokens = tokens.masked_fill(torch.isneginf(vals)[..., None], -1)
            out[start:stop, : keep * kpool] = tokens.flatten(1).to(out.dtype)
    if tail and kpool > 1:  # the visible incomplete pool, right after the pools (transformers' column layout)
        count = (position + 1) % kpool
        offsets = torch.arange(kpool - 1, device=q.device)
        tail_tokens = (position + 1 - count)[:, None] + offsets
        out[:, keep * kpool : keep * kpool + kpool - 1] = tail_tokens.masked_fill(offsets >= count[:, None], -1).to(out.dtype)


@torch.no_grad()
def kpool_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    kpool: int,
    always_select_tail: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Top-k key positions per query over k-pool compressed keys (see the module docstring).

    q [Tq, H, D] indexer query heads; k [Tk, D] or [Tk, 1, D] the shared key head (after k_norm); gate [Tk, D]
    each key token's compress-gate scores (hidden @ index_kpool_compress_gate^T); ape [kpool, D]; weights [Tq, H]
    per-head gates (the caller already multiplied by H**-0.5, as transformers does). Default scale D**-0.5.
    topk: a multiple of kpool. Returns int32 [Tq, topk + (kpool - 1 if always_select_tail else 0)]: the chosen
    pools' tokens, best pool first, then the tail, -1 in unused slots (transformers' layout). Among equal
    pool scores the lowest pool wins (`stable_topk`; torch.topk's order between ties is unspecified).
    Always causal (bottom-right aligned segments as in `attention`). Computed in float32 (float64 stays float64),
    except the pools' weighted key sums, in the keys' dtype as transformers computes them.
    """
    topk, kpool = int(topk), int(kpool)
    k = _check(q, k, gate, ape, weights, topk, kpool)
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    scale = default_scale(q, softmax_scale)
    out = torch.full((q.shape[0], output_width(topk, kpool, always_select_tail)), -1, dtype=torch.int32,
                     device=q.device)
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0 or sk == 0:
            continue
        if sq > sk:
            raise ValueError(f"kpool_indexer: query segment {b} has {sq} rows but its key segment only {sk} keys "
                             "(the queries are the last positions of their key segment)")
        _sequence(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], gate[ck[b] : ck[b + 1]], ape,
                  weights[cq[b] : cq[b + 1]], out[cq[b] : cq[b + 1]], topk, kpool, always_select_tail, scale)
    return out
