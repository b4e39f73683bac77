"""SIMULATED npu_fusion_attention, npu_lightning_indexer, npu_sparse_flash_attention (float64 math).

Simulated subset: layouts TND / BSND / BNSD (fusion attention), TND / BSND (indexer), TND (sparse
flash attention); sparse_mode 0, 2, 3 (and 1 for a full mask); no dropout, pse, prefix or paging.
Anything else raises, as does every documented-contract violation.
"""

from __future__ import annotations

import torch

from ._common import check, check_contiguous, defect, doc, f64, fail, is_950, require_soc, soc

_MAX_INT32 = 2147483647
_MAX_INT64 = 9223372036854775807
_LOW = (torch.float16, torch.bfloat16)


def _softmax_rows(scores: torch.Tensor, masked: torch.Tensor | None):
    """scores [..., S, Sk] float64, masked True = out. Fully masked rows give 0 output."""
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    mx = scores.amax(dim=-1, keepdim=True)
    safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    e = torch.exp(scores - safe)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s), mx, s


def _attend(q, k, v, masked, scale):
    """q [S, N, D], k [Sk, Nkv, D], v [Sk, Nkv, Dv] float64; masked [S, Sk] or [N, S, Sk] bool."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("snd,tnd->nst", q, k) * scale
    probs, mx, sm = _softmax_rows(scores, masked)
    return torch.einsum("nst,tnd->snd", probs, v), mx[..., 0], sm[..., 0]


def _check_compressed_mask(op: str, mask) -> None:
    check(mask is not None, op, "sparse_mode 2/3 need atten_mask = the compressed 2048x2048 upper-triangular mask")
    check(mask.dtype in (torch.bool, torch.uint8), op, f"atten_mask must be bool/uint8, got {mask.dtype}")
    check(tuple(mask.shape) == (2048, 2048), op, f"sparse_mode 2/3 take the compressed [2048, 2048] mask, got {tuple(mask.shape)}")
    expected = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=mask.device), diagonal=1)
    check(bool(torch.equal(mask.bool(), expected)), op, "atten_mask must be triu(ones(2048, 2048), 1) (True = masked out)")


def _seq_mask(sparse_mode, sq, sk, mask2d, device):
    """True = masked out, for one sequence of sq queries and sk keys."""
    if sparse_mode == 3:
        return ~torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)
    if sparse_mode == 2:
        return ~torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0)
    if mask2d is None:
        return None
    return mask2d[..., :sq, :sk].bool()


def _ends(op: str, name: str, value, total: int) -> list[int]:
    check(value is not None, op, f"{name} is required for input_layout TND")
    if isinstance(value, torch.Tensor):
        raise fail(op, f"argument '{name}' must be int[] (a host list of ints), not Tensor")  # torch.ops: RuntimeError
    ends = [int(v) for v in value]
    while len(ends) > 1 and ends[-1] == 0:  # documented: trailing zeros exclude trailing batches
        ends.pop()
    check(1 <= len(ends) <= 1024, op, f"{name} must list 1..1024 sequences in varlen, got {len(ends)}")
    check(all(e >= 0 for e in ends) and all(b >= a for a, b in zip(ends, ends[1:])), op,
          f"{name} must be non-decreasing cumulative lengths, got {ends[:8]}")
    check(ends[-1] == total, op, f"{name} ends at {ends[-1]} but the tensor has {total} tokens")
    return ends


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=_MAX_INT32, next_tockens=_MAX_INT32, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """-> (attention_out, softmax_max, softmax_sum, reserved, seed, offset, numels). scale defaults to 1.0."""
    op = "npu_fusion_attention"
    require_soc(op)
    check(input_layout in ("TND", "BSND", "BNSD", "BSH", "SBH"), op, f"unknown input_layout {input_layout!r}")
    check(input_layout in ("TND", "BSND", "BNSD"), op, f"layout {input_layout} is not simulated")
    check(pse is None and padding_mask is None and prefix is None and sink is None and dropout_mask is None, op,
          "pse / padding_mask / prefix / sink / dropout_mask are not simulated")
    check(keep_prob == 1.0, op, "dropout (keep_prob < 1) is not simulated")
    check(sparse_mode in (0, 1, 2, 3), op, f"sparse_mode {sparse_mode} is not simulated")
    check(query.dtype == key.dtype == value.dtype, op, "query, key and value must have the same dtype")
    check(query.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"unsupported dtype {query.dtype}")
    want = 3 if input_layout == "TND" else 4
    check(query.dim() == want and key.dim() == want and value.dim() == want, op,
          f"layout {input_layout} needs {want}-D query/key/value, got {query.dim()}-D/{key.dim()}-D/{value.dim()}-D")
    if input_layout == "BNSD":
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> BSND
    else:
        q, k, v = query, key, value
    nq, nkv = q.shape[-2], k.shape[-2]
    check(int(head_num) == nq, op, f"head_num={head_num} but query has {nq} heads")
    check(nkv > 0 and nq % nkv == 0 and nq <= 256, op, f"query heads {nq} must be a multiple of key heads {nkv}, <= 256")
    check(k.shape[:-1] == v.shape[:-1], op, "key and value must have the same shape except the head dim")
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    check(dq == dk and dk >= dv and dq <= 768, op, f"need Dq == Dk >= Dv and D <= 768, got {dq}, {dk}, {dv}")
    if sparse_mode in (2, 3):
        _check_compressed_mask(op, atten_mask)
    elif atten_mask is not None:
        check(atten_mask.dtype in (torch.bool, torch.uint8), op, "atten_mask must be bool/uint8 (1 = masked out)")
    else:
        check(pre_tockens == _MAX_INT32 and next_tockens == _MAX_INT32, op, "pre/next_tockens windows are not simulated")
    scale = float(scale)
    if input_layout == "TND":
        ends_q = _ends(op, "actual_seq_qlen", actual_seq_qlen, q.shape[0])
        ends_k = _ends(op, "actual_seq_kvlen", actual_seq_kvlen, k.shape[0])
        check(len(ends_q) == len(ends_k), op, "actual_seq_qlen and actual_seq_kvlen must list the same batches")
        check(q.shape[0] > 0 and k.shape[0] > 0, op, "T must be >= 1")
        check(sparse_mode != 1, op, "varlen takes only the SS mask shape; sparse_mode 1 is not simulated for TND")
        if atten_mask is not None and sparse_mode == 0:
            check(atten_mask.dim() == 2, op, "in varlen (TND) atten_mask must be [maxSq, maxSkv]")
        outs, maxes, sums = [], [], []
        sq0 = sk0 = 0
        for eq, ek in zip(ends_q, ends_k):
            sq, sk = eq - sq0, ek - sk0
            qb, kb, vb = f64(q[sq0:eq]), f64(k[sk0:ek]), f64(v[sk0:ek])
            if sq:
                if sk == 0:
                    outs.append(qb.new_zeros(sq, nq, dv))
                    maxes.append(qb.new_zeros(nq, sq))
                    sums.append(qb.new_zeros(nq, sq))
                else:
                    masked = _seq_mask(sparse_mode, sq, sk, atten_mask if sparse_mode == 0 else None, q.device)
                    o, mx, sm = _attend(qb, kb, vb, masked, scale)
                    outs.append(o)
                    maxes.append(mx)
                    sums.append(sm)
            sq0, sk0 = eq, ek
        out = torch.cat(outs, dim=0).to(query.dtype)
        mx, sm = torch.cat(maxes, dim=1), torch.cat(sums, dim=1)  # [N, T]
        if softmax_layout == "TND":
            mx, sm = mx.transpose(0, 1), sm.transpose(0, 1)
        stats = [t.unsqueeze(-1).expand(*t.shape, 8).detach().to(torch.float32) for t in (mx, sm)]
    else:
        check(actual_seq_qlen is None and actual_seq_kvlen is None, op, "actual_seq_qlen/kvlen are for TND only")
        check(q.shape[0] == k.shape[0], op, "batch sizes of query and key differ")
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        mask = None
        if atten_mask is not None and sparse_mode in (0, 1):
            check(atten_mask.dim() in (2, 4) and tuple(atten_mask.shape[-2:]) == (sq, sk), op,
                  f"atten_mask must be [S1, S2] or [B|1, N|1, S1, S2] = ({sq}, {sk}), got {tuple(atten_mask.shape)}")
            mask = atten_mask.bool()
        if mask is not None:  # documented: padding rows (all masked) are not supported
            check(not bool(mask.all(dim=-1).any()), op, "atten_mask has a row that masks every key")
        outs, maxes, sums = [], [], []
        for i in range(b):
            mi = mask if mask is None or mask.dim() == 2 else mask[min(i, mask.shape[0] - 1)]
            masked = _seq_mask(sparse_mode, sq, sk, mi, q.device)
            o, mx, sm = _attend(f64(q[i]), f64(k[i]), f64(v[i]), masked, scale)
            outs.append(o)
            maxes.append(mx)
            sums.append(sm)
        out = torch.stack(outs).to(query.dtype)  # BSND
        if input_layout == "BNSD":
            out = out.transpose(1, 2)
        stats = [torch.stack(t).unsqueeze(-1).expand(-1, -1, -1, 8).detach().to(torch.float32) for t in (maxes, sums)]
    return out, stats[0], stats[1], query.new_empty(0), int(seed), int(offset), 0


def _int32_prefix(op, name, t, batches=None):
    check(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, op,
          f"{name} must be a 1-D int32 tensor of cumulative token counts (TND)")
    ends = [int(x) for x in t.tolist()]
    check(all(b >= a for a, b in zip(ends, ends[1:])) and all(e >= 0 for e in ends), op,
          f"{name} must be non-decreasing prefix sums, got {ends[:8]}")
    if batches is not None:
        check(len(ends) == batches, op, f"{name} must have one entry per batch")
    return ends


def _key_ends(op, name, t, batches, total, misread):
    """TND key/kv lengths. The docstrings (every wheel read) call actual_seq_lengths_key / _kv each batch's
    valid token count, and only the query's lengths prefix sums: counts, summing to T2. `misread` is the
    deliberate defect that takes them as prefix sums (finite but wrong for more than one batch)."""
    check(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, op,
          f"{name} must be a 1-D int32 tensor of per-batch token counts (TND)")
    vals = [int(x) for x in t.tolist()]
    check(len(vals) == batches, op, f"{name} must have one entry per batch")
    check(all(v >= 0 for v in vals), op, f"{name} must be non-negative")
    if misread:
        return [min(v, total) for v in vals]
    if doc(op).get("key_lengths", "valid_token_counts") == "prefix_sums":
        return _int32_prefix(op, name, t, batches)
    check(sum(vals) == total, op, f"{name} are per-batch token counts and must sum to T2={total}, got {vals[:8]}")
    ends, acc = [], 0
    for v in vals:
        acc += v
        ends.append(acc)
    return ends


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=_MAX_INT64, next_tokens=_MAX_INT64, return_value=False):
    """Indices = TopK over keys of sum_h W[h] * ReLU(q_h . k) (no scale), per query token.
    -> (sparse_indices int32 [T1, 1, sparse_count] (TND) / [B, S1, 1, sparse_count], sparse_values).
    Indices are key positions within the query's batch, best first; -1 fills unused slots."""
    op = "npu_lightning_indexer"
    check(layout_query in ("BSND", "TND") and layout_key in ("BSND", "TND", "PA_BSND"), op, "unknown layout")
    check(layout_key != "PA_BSND" and block_table is None, op, "PagedAttention (PA_BSND) is not simulated")
    check(layout_query == layout_key, op, "layout_key must equal layout_query without PagedAttention")
    check_contiguous(op, query=query, key=key, weights=weights)
    check(query.dtype in _LOW and key.dtype == query.dtype, op, "query/key must be bfloat16/float16 and match")
    check(weights.dtype == query.dtype or weights.dtype == torch.float32, op, "weights must have query's dtype (or float32)")
    check(sparse_count in set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}, op, f"bad sparse_count {sparse_count}")
    check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    check(pre_tokens == _MAX_INT64 and next_tokens == _MAX_INT64, op, "only default pre/next_tokens are supported")
    tnd = layout_query == "TND"
    want = 3 if tnd else 4
    check(query.dim() == want and key.dim() == want, op, f"layout {layout_query} needs {want}-D query and key")
    n1, n2, d = query.shape[-2], key.shape[-2], query.shape[-1]
    check(n2 == 1, op, f"key must have exactly 1 head (N2 == 1), got {n2}")
    check(n1 <= 64, op, f"query heads N1 must be <= 64, got {n1}")
    if is_950():
        check(n1 in (8, 16, 24, 32, 64), op, f"on {soc()} query heads N1 must be 8, 16, 24, 32 or 64, got {n1}")
        check(weights.dtype != torch.float32, op, f"on {soc()} weights must not be float32")
    check(d == 128 and key.shape[-1] == 128, op, f"head dim D must be 128, got {d}/{key.shape[-1]}")
    check(tuple(weights.shape) == tuple(query.shape[:-1]), op, f"weights must be {tuple(query.shape[:-1])}")
    if tnd:
        ends_q = _int32_prefix(op, "actual_seq_lengths_query", actual_seq_lengths_query)
        check(ends_q[-1] == query.shape[0], op, "actual_seq_lengths_query (prefix sums) must end at T1")
        ends_k = _key_ends(op, "actual_seq_lengths_key", actual_seq_lengths_key, len(ends_q), key.shape[0],
                           defect("npu_lightning_indexer:key_lengths_as_prefix_sums"))
        spans = list(zip([0] + ends_q[:-1], ends_q, [0] + ends_k[:-1], ends_k))
        qs, ks, ws = query, key[:, 0], weights
    else:
        b = query.shape[0]
        spans = [(i * query.shape[1], (i + 1) * query.shape[1], i * key.shape[1], (i + 1) * key.shape[1]) for i in range(b)]
        qs, ks, ws = query.flatten(0, 1), key.flatten(0, 1)[:, 0], weights.flatten(0, 1)
    idx_out = torch.full((qs.shape[0], sparse_count), -1, dtype=torch.int32, device=query.device)
    val_out = torch.zeros(qs.shape[0], sparse_count, dtype=query.dtype, device=query.device)
    for q0, q1, k0, k1 in spans:
        sq, sk = q1 - q0, k1 - k0
        if sq == 0 or sk == 0:
            continue
        s = torch.einsum("shd,td->sht", f64(qs[q0:q1]), f64(ks[k0:k1])).clamp_min(0)
        score = torch.einsum("sh,sht->st", f64(ws[q0:q1]), s)
        if sparse_mode == 3:
            score = score.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=score.device).tril(sk - sq), float("-inf"))
        order = torch.argsort(-score, dim=-1, stable=True)[:, :sparse_count]
        vals = score.gather(1, order)
        kk = order.shape[1]
        idx_out[q0:q1, :kk] = torch.where(torch.isinf(vals), -1, order).to(torch.int32)
        val_out[q0:q1, :kk] = torch.where(torch.isinf(vals), 0.0, vals).to(query.dtype)
    shape = (qs.shape[0], 1, sparse_count) if tnd else (query.shape[0], query.shape[1], 1, sparse_count)
    values = val_out.view(shape) if return_value else query.new_empty(0)
    return idx_out.view(shape), values


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=_MAX_INT64, next_tokens=_MAX_INT64, attention_mode=0,
                               return_softmax_lse=False):
    """softmax(scale * [q_nope|q_rope] . [k_nope|k_rope]) @ value over the keys listed in sparse_indices
    (MLA-absorb, attention_mode=2). -> (attention_out, softmax_max, softmax_sum)."""
    op = "npu_sparse_flash_attention"
    check(layout_query in ("BSND", "TND") and layout_kv in ("BSND", "TND", "PA_BSND"), op, "unknown layout")
    check(layout_query == "TND" and layout_kv == "TND" and block_table is None, op, "only TND/TND is simulated")
    check(attention_mode == 2, op, f"only attention_mode=2 (MLA-absorb) is supported, got {attention_mode}")
    check(sparse_block_size == 1, op, "only sparse_block_size=1 is simulated")
    check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    check(pre_tokens == _MAX_INT64 and next_tokens == _MAX_INT64, op, "only default pre/next_tokens are supported")
    check(isinstance(scale_value, float), op, "scale_value must be a float")
    check(query_rope is not None and key_rope is not None, op, "attention_mode=2 needs query_rope and key_rope")
    check_contiguous(op, query=query, key=key, value=value, sparse_indices=sparse_indices, query_rope=query_rope, key_rope=key_rope)
    check(query.dtype in _LOW and all(t.dtype == query.dtype for t in (key, value, query_rope, key_rope)), op,
          "query/key/value/ropes must share a bfloat16/float16 dtype")
    check(query.dim() == 3 and key.dim() == 3 and value.dim() == 3, op, "TND needs 3-D query/key/value")
    check(key.shape[1] == 1 and value.shape == key.shape, op, "key/value must be [T2, 1, D] and identical in shape")
    n1 = query.shape[1]
    if is_950():
        check(1 <= n1 <= 128, op, f"on {soc()} query heads must be 1..128, got {n1}")
    else:
        check(1 <= n1 <= 128 and n1 & (n1 - 1) == 0, op, f"on {soc()} query heads must be a power of two <= 128, got {n1}")
    check(query.shape[-1] == 512 and key.shape[-1] == 512, op, "D of query/key/value must be 512")
    check(query_rope.shape[-1] == 64 and key_rope.shape[-1] == 64, op, "D of query_rope/key_rope must be 64")
    check(query_rope.shape[:-1] == query.shape[:-1] and key_rope.shape[:-1] == key.shape[:-1], op, "rope shapes mismatch")
    check(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 3 and sparse_indices.shape[:2] == (query.shape[0], 1),
          op, f"sparse_indices must be int32 [T1, 1, sparse_size], got {sparse_indices.dtype} {tuple(sparse_indices.shape)}")
    valid = sparse_indices[:, 0] >= 0
    check(bool((valid[:, 1:] <= valid[:, :-1]).all()), op, "sparse_indices: valid entries first, -1 after")
    ends_q = _int32_prefix(op, "actual_seq_lengths_query", actual_seq_lengths_query)
    check(ends_q[-1] == query.shape[0], op, "actual_seq_lengths_query (prefix sums) must end at T1")
    ends_k = _key_ends(op, "actual_seq_lengths_kv", actual_seq_lengths_kv, len(ends_q), key.shape[0],
                       defect("npu_sparse_flash_attention:kv_lengths_as_prefix_sums"))
    q = torch.cat((f64(query), f64(query_rope)), dim=-1)
    k = torch.cat((f64(key), f64(key_rope)), dim=-1)
    v = f64(value)
    outs, maxes, sums = [], [], []
    for q0, q1, k0, k1 in zip([0] + ends_q[:-1], ends_q, [0] + ends_k[:-1], ends_k):
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        idx = sparse_indices[q0:q1, 0].long()
        if defect("npu_sparse_flash_attention:kv_lengths_as_prefix_sums"):
            idx = torch.where(idx >= sk, -1, idx)  # the defective kernel drops what its misread lengths exclude
        check(bool((idx < sk).all()), op, "sparse_indices must be < the batch's kv length")
        selected = torch.zeros(sq, sk + 1, dtype=torch.bool, device=query.device)
        selected.scatter_(1, torch.where(idx < 0, sk, idx), True)
        allowed = selected[:, :sk]
        if sparse_mode == 3:
            allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        o, mx, sm = _attend(q[q0:q1], k[k0:k1], v[k0:k1], ~allowed, scale_value)
        outs.append(o)
        maxes.append(mx)
        sums.append(sm)
    out = torch.cat(outs).to(query.dtype)
    if return_softmax_lse:
        stats = [torch.cat(t, dim=1).transpose(0, 1).unsqueeze(0).detach().to(torch.float32) for t in (maxes, sums)]  # [N2, T1, N1]
    else:
        stats = [query.new_empty(0, dtype=torch.float32)] * 2
    return out, stats[0], stats[1]
