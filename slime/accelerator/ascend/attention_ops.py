"""Ascend mappings of the attention ops: dense attention (npu_fusion_attention, TND), DSA sparse attention
(npu_fusion_attention with a mask, or npu_sparse_flash_attention for absorbed-MLA shapes) and the lightning
indexer (npu_lightning_indexer). Each calls the reference for inputs its kernel does not take."""

from __future__ import annotations

import torch

from slime.accelerator.ascend.kernels import (
    FLOATS, LOW_PRECISION, _host_offsets, _kernel, _sequence_lengths, _unsupported, current_soc,
)
from slime.accelerator.ascend.support import is_950
from slime.accelerator.ops import reference
from slime.accelerator.ops.reference import check_attention_shapes, default_scale, packed_offsets

# --- attention ------------------------------------------------------------------------------

_CAUSAL_MASKS: dict[torch.device, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 upper-triangular mask (True = masked out) that sparse_mode 2/3 take."""
    mask = _CAUSAL_MASKS.get(device)
    if mask is None:
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
        _CAUSAL_MASKS[device] = mask
    return mask


def _fusion_attention_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # Documented limits: Nq <= 256, Dq == Dk >= Dv, D <= 768, same dtype.
    return (
        q.dtype in FLOATS and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[1] <= 256
        and q.shape[2] <= 768 and v.shape[2] <= q.shape[2] and q.shape[0] > 0 and k.shape[0] > 0
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    check_attention_shapes(q, k, v)
    seq_q = _host_offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    seq_k = _host_offsets(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q has {len(seq_q)} sequences, cu_seqlens_k {len(seq_k)}")
    if not _fusion_attention_takes(q, k, v):
        return reference.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    if len(seq_q) > _TND_MAX_SEQUENCES:  # (context parallel doubles the segments of a pack) one call per slice
        return _attention_in_slices(q, k, v, [0] + seq_q, [0] + seq_k, causal, softmax_scale)
    scale = default_scale(q, softmax_scale)
    outs = _kernel("npu_fusion_attention")(
        q, k, v, q.shape[1], "TND",
        atten_mask=compressed_causal_mask(q.device) if causal else None,
        scale=scale,
        actual_seq_qlen=seq_q,
        actual_seq_kvlen=seq_k,
        sparse_mode=3 if causal else 0,  # 3 = causal aligned bottom-right, as flash-attn
    )
    return outs[0]


_TND_MAX_SEQUENCES = 1024  # npu_fusion_attention TND takes at most 1K sequences per call


def _attention_in_slices(q, k, v, cq: list[int], ck: list[int], causal: bool, softmax_scale):
    """Sequences are independent: `attention` over consecutive slices of at most 1K sequences, concatenated."""
    outs = []
    for s in range(0, len(cq) - 1, _TND_MAX_SEQUENCES):
        e = min(s + _TND_MAX_SEQUENCES, len(cq) - 1)
        q0, q1, k0, k1 = cq[s], cq[e], ck[s], ck[e]
        if q1 == q0:
            continue
        cu_q = torch.tensor([x - q0 for x in cq[s:e + 1]], dtype=torch.int32)
        cu_k = torch.tensor([x - k0 for x in ck[s:e + 1]], dtype=torch.int32)
        outs.append(attention(q[q0:q1], k[k0:k1], v[k0:k1], cu_q, cu_k, causal, softmax_scale))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


# Absorbed-MLA shapes npu_sparse_flash_attention takes: one latent kv head of 512 (+64 rope) dims.
_SFA_NOPE, _SFA_ROPE = 512, 64


def _is_absorbed_mla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        k.shape[1] == 1 and q.shape[2] == _SFA_NOPE + _SFA_ROPE and v.shape[2] == _SFA_NOPE
        and q.dtype in LOW_PRECISION and k.dtype == q.dtype and v.dtype == q.dtype
        and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()  # v is k's latent part
    )


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
    check_attention_shapes(q, k, v)
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    if topk_indices.dim() != 2 or topk_indices.shape[0] != q.shape[0]:
        return reference.sparse_attention(q, k, v, topk_indices, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    scale = default_scale(q, softmax_scale)
    if _is_absorbed_mla(q, k, v) and _SFA_OK[0] and q.shape[0] > 0:
        if _sfa_heads_ok(q.shape[1]):
            return _sparse_flash_attention(q, k, topk_indices, cq, ck, causal, scale)
        _unsupported("sparse_attention", f"npu_sparse_flash_attention on {current_soc()} takes head counts "
                     f"{_SFA_HEADS_DOC[is_950(current_soc())]}, got {q.shape[1]}; npu_fusion_attention per sequence")
    if not _fusion_attention_takes(q, k, v):
        return reference.sparse_attention(q, k, v, topk_indices, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    # General shapes (expanded MLA, GQA): per sequence, npu_fusion_attention with the explicit mask
    # (True = masked out). Dense cost, but no [H, S, S] float scores in memory.
    kernel = _kernel("npu_fusion_attention")
    outs = []
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0:
            continue
        if sk == 0:
            outs.append(q.new_zeros(sq, q.shape[1], v.shape[2]))
            continue
        idx = topk_indices[cq[b] : cq[b + 1]].long()
        selected = torch.zeros(sq, sk + 1, dtype=torch.bool, device=q.device)
        selected.scatter_(1, torch.where((idx < 0) | (idx >= sk), sk, idx), True)
        allowed = selected[:, :sk]
        if causal:
            allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        empty = ~allowed.any(dim=-1)  # the kernel does not define fully masked rows: let them see key 0, then zero
        has_empty = bool(empty.any())
        if has_empty:
            allowed = allowed.clone()
            allowed[empty, 0] = True
        out = kernel(
            q[cq[b] : cq[b + 1]].unsqueeze(0), k[ck[b] : ck[b + 1]].unsqueeze(0), v[ck[b] : ck[b + 1]].unsqueeze(0),
            q.shape[1], "BSND", atten_mask=(~allowed).view(1, 1, sq, sk), scale=scale, sparse_mode=0,
        )[0][0]
        outs.append(out.masked_fill(empty.view(-1, 1, 1), 0.0) if has_empty else out)
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.cat(outs, dim=0)


_SFA_OK = [False]  # npu_sparse_flash_attention present (7.3.0+) and its probe passed (set by resolve)
_SFA_HEADS_DOC = {False: "a power of two <= 128 (A2/A3)", True: "1..128 (Ascend 950)"}


def _sfa_heads_ok(n: int) -> bool:
    if is_950(current_soc()):
        return 1 <= n <= 128
    return 1 <= n <= 128 and n & (n - 1) == 0


def _sparse_flash_attention(q, k, topk_indices, cq, ck, causal, scale):
    """Absorbed MLA: q = [q_nope(512) | q_rope(64)] per head, k = [latent(512) | k_rope(64)] one head,
    v = the latent part of k."""
    latent = k[..., :_SFA_NOPE].contiguous()
    # Positions past a query segment's keys are future keys (context parallel chunks): the kernel's contract
    # has no such index, so they become unused slots (-1), which causal masking would give anyway.
    key_len = torch.tensor(_sequence_lengths(ck), device=topk_indices.device)
    key_len = key_len.repeat_interleave(torch.tensor(_sequence_lengths(cq), device=topk_indices.device))
    topk_indices = torch.where(topk_indices.long() >= key_len[:, None], -1, topk_indices.long())
    # Kernel contract: valid indices first, -1 after; descending sort gives that.
    idx = torch.sort(topk_indices.to(torch.int32), dim=-1, descending=True).values
    dev = q.device
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    out = _kernel("npu_sparse_flash_attention")(
        q[..., :_SFA_NOPE].contiguous(), latent, latent, idx.unsqueeze(1).contiguous(), scale,
        # Docstring: the query's TND lengths are prefix sums, the kv lengths each batch's valid token count.
        actual_seq_lengths_query=torch.tensor(cq[1:], dtype=torch.int32, device=dev),
        actual_seq_lengths_kv=torch.tensor(_sequence_lengths(ck), dtype=torch.int32, device=dev),
        query_rope=q[..., _SFA_NOPE:].contiguous(), key_rope=k[..., _SFA_NOPE:].contiguous(),
        sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=3 if causal else 0,
        attention_mode=2, return_softmax_lse=need_grad,  # softmax statistics feed the backward
    )
    return out[0]


_INDEXER_SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
_INDEXER_950_HEADS = (8, 16, 24, 32, 64)  # Ascend 950: the only query head counts the indexer takes


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
    k3 = k.unsqueeze(1) if k.dim() == 2 else k
    scale = default_scale(q, softmax_scale)
    takes = (
        q.dim() == 3 and k3.dim() == 3 and k3.shape[1] == 1 and q.shape[-1] == 128 and k3.shape[-1] == 128
        and q.shape[1] <= 64 and q.dtype in LOW_PRECISION and k3.dtype == q.dtype and int(topk) in _INDEXER_SPARSE_COUNTS
        and scale > 0 and q.shape[0] > 0 and k3.shape[0] > 0 and weights.shape == q.shape[:2]
    )
    if takes and is_950(current_soc()) and q.shape[1] not in _INDEXER_950_HEADS:
        _unsupported("lightning_indexer", f"npu_lightning_indexer on {current_soc()} takes {_INDEXER_950_HEADS} "
                     f"query heads, got {q.shape[1]}")
        takes = False
    if not takes:
        return reference.lightning_indexer(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk, causal, softmax_scale)
    seq_q = _host_offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    seq_k = _host_offsets(cu_seqlens_k, k3.shape[0], "cu_seqlens_k")
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q has {len(seq_q)} sequences, cu_seqlens_k {len(seq_k)}")
    # Tie order is the kernel's, not the reference's lowest-position rule (docs/ops.md): which of several
    # exactly equal scores survive the cut is not documented, and canonicalising would need every key's
    # score, the [Tq, Tk] matrix the kernel exists to avoid. The kernel has no scale: relu(s * q.k) =
    # s * relu(q.k) for s > 0, so fold s into the weights. The weights go in q's dtype: the Ascend 950
    # refuses float32 weights.
    w = (weights.float() * scale).to(q.dtype).contiguous()
    with torch.no_grad():
        indices = _kernel("npu_lightning_indexer")(
            q.contiguous(), k3.contiguous(), w,
            # Docstring: the query's TND lengths are prefix sums, the key's each batch's valid token count.
            actual_seq_lengths_query=torch.tensor(seq_q, dtype=torch.int32, device=q.device),
            actual_seq_lengths_key=torch.tensor(_sequence_lengths([0] + seq_k), dtype=torch.int32, device=q.device),
            layout_query="TND", layout_key="TND", sparse_count=int(topk), sparse_mode=3 if causal else 0,
        )[0]
    return indices.view(q.shape[0], int(topk)).to(torch.int32)
