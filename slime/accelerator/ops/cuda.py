"""CUDA implementations of the slime ops (provider for accelerator "cuda").

attention: flash-attn's varlen kernel when flash_attn is installed (fp16/bf16, head dim <= 256), else
torch SDPA per sequence. sparse_attention: SDPA per sequence with the DSA mask. grouped_matmul:
torch._grouped_mm (torch >= 2.8). kda, causal_conv1d: fla-core / causal-conv1d where installed
(cuda_kda.py). The rest stay on the reference until a kernel measures faster
(benchmarks/ops.py). The functions only use torch APIs, so they also run (and are tested) on CPU tensors.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from slime.accelerator.ops import DeviceOp, cuda_kda, log_once, reference
from slime.accelerator.ops.reference import causal_mask, check_attention_shapes, default_scale, packed_offsets

_FLASH: list[Any] = []  # [flash_attn_varlen_func or None], probed once


def flash_attn_varlen() -> Callable | None:
    if not _FLASH:
        try:
            _FLASH.append(importlib.import_module("flash_attn").flash_attn_varlen_func)
        except Exception:
            _FLASH.append(None)
    return _FLASH[0]


def _sdpa_sequence(qb, kb, vb, allowed, scale, causal_square):
    """One sequence through SDPA: qb [Sq, Hq, D], kb/vb [Sk, Hkv, *] -> [Sq, Hq, Dv]. `allowed` [Sq, Sk]
    (True = may attend) or None with causal_square (plain causal). Rows without a key give 0."""
    rep = qb.shape[1] // kb.shape[1]
    q = qb.transpose(0, 1).unsqueeze(0)
    k = kb.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    v = vb.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    if allowed is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, scale=scale)
        return out[0].transpose(0, 1)
    empty = ~allowed.any(dim=-1)
    has_empty = bool(empty.any())
    if has_empty:  # SDPA gives NaN for rows with no key; let them see key 0, then zero them
        allowed = allowed.clone()
        allowed[empty, 0] = True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)[0].transpose(0, 1)
    return out.masked_fill(empty.view(-1, 1, 1), 0.0) if has_empty else out


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
    cq, ck = packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    scale = default_scale(q, softmax_scale)
    flash = flash_attn_varlen()
    dqk, dv = q.shape[-1], v.shape[-1]
    if flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dv <= dqk <= 256 and q.shape[0]:
        # flash-attn wants one head dim for q, k, v: zero-pad v and drop the padding after.
        vp = F.pad(v, (0, dqk - dv)) if dv < dqk else v
        out = flash(
            q, k, vp, cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device), max(b - a for a, b in zip(cq, cq[1:])),
            max(b - a for a, b in zip(ck, ck[1:])), dropout_p=0.0, softmax_scale=scale, causal=causal,
        )
        return out[..., :dv] if dv < dqk else out
    return _sdpa_attention(q, k, v, cq, ck, causal, scale)


def _sdpa_attention(q, k, v, cq, ck, causal, scale):
    outs = []
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0:
            continue
        if sk == 0:
            outs.append(q.new_zeros(sq, q.shape[1], v.shape[2]))
            continue
        qb, kb, vb = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        if not causal or sq == sk:
            outs.append(_sdpa_sequence(qb, kb, vb, None, scale, causal))
        else:  # bottom-right alignment needs an explicit mask (SDPA's is_causal is top-left)
            outs.append(_sdpa_sequence(qb, kb, vb, causal_mask(sq, sk, q.device), scale, False))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


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
            allowed = allowed & causal_mask(sq, sk, q.device)
        outs.append(_sdpa_sequence(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], allowed, scale, False))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (_grouped_mm's backward rejects
    broadcast gradients such as the one `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


_GROUPED_MM_OK = [True]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    reference.check_grouped_matmul(x, w)
    counts = reference.tokens_per_expert_to_host(tokens_per_expert, w.shape[0], x.shape[0])
    usable = (
        _GROUPED_MM_OK[0] and x.dtype in (torch.bfloat16, torch.float32) and w.dtype == x.dtype and x.shape[0] > 0
        and x.shape[1] % 8 == 0 and w.shape[2] % 8 == 0  # 16-byte aligned rows for the kernel
    )
    if not usable:
        return reference.grouped_matmul(x, w, tokens_per_expert)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
    try:
        y = torch._grouped_mm(x, w, offs=offs)
    except RuntimeError as e:  # e.g. a GPU generation the kernel does not support
        _GROUPED_MM_OK[0] = False
        log_once(f"ops[cuda].grouped_matmul: torch._grouped_mm failed ({str(e).splitlines()[0]}); using the reference")
        return reference.grouped_matmul(x, w, tokens_per_expert)
    return _ContiguousGrad.apply(y)


def resolve(op_name: str, acc) -> DeviceOp | None:
    """Provider hook for slime.accelerator.ops."""
    if op_name in cuda_kda.OPS:
        return cuda_kda.resolve(op_name)
    if op_name == "attention":
        source = "flash_attn.flash_attn_varlen_func" if flash_attn_varlen() else "torch.nn.functional.scaled_dot_product_attention"
        return DeviceOp(attention, source)
    if op_name == "sparse_attention":
        return DeviceOp(sparse_attention, "torch.nn.functional.scaled_dot_product_attention (DSA mask)")
    if op_name == "grouped_matmul":
        if not hasattr(torch, "_grouped_mm"):
            return DeviceOp(None, "", f"torch {torch.__version__} has no torch._grouped_mm (needs torch >= 2.8)")
        return DeviceOp(grouped_matmul, "torch._grouped_mm")
    return None
