"""Ascend implementations of the slime ops, on torch_npu fused kernels (provider for accelerator "npu").

Each function has the reference signature (slime/accelerator/ops/reference.py) and calls the reference
itself for inputs its kernel does not take (documented kernel limits: dtypes, head dims, layouts).
torch_npu is looked up at call time, so the documented-contract simulator in tests/npu_sim can stand in.
`MAPPINGS` records which torch_npu release each mapping needs (`since`, compared with the installed
torch_npu's release); docs/ops.md has the same table. Input limits of a SoC (the Ascend 950's indexer
head counts, the sparse flash attention's head counts on A2/A3) are checked per call: the reference (or
the next kernel) with one log line. Each mapping is probed once per process and mode before use: its
result is compared with the float64 reference (probes.py); a failing mode uses the reference.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime.accelerator.ascend import kda_ops, probes
from slime.accelerator.ascend.support import (
    documented_on, is_950, release_key, release_of, requirement, soc_of,
)
from slime.accelerator.ops import DeviceOp, log_once, reference
from slime.accelerator.ops.reference import (
    check_attention_shapes, check_rotary_dim, default_scale, packed_offsets, rotary_pair_angles, seqlens_to_host,
)

@dataclass(frozen=True)
class NpuMapping:
    op: str
    kernels: tuple[str, ...]  # torch_npu functions that must exist
    since: str  # first PTA release (op-plugin branch) whose op_plugin_functions.yaml has them with the arguments used
    backward: str  # where the gradient comes from

    def requirement(self) -> str:
        return requirement(self.since)


MAPPINGS: dict[str, NpuMapping] = {
    m.op: m
    for m in (
        NpuMapping("rms_norm", ("npu_rms_norm",), "6.0.0", "native (npu_rms_norm_backward)"),
        NpuMapping("apply_rotary", ("npu_rotary_mul",), "6.0.0",
                   "native (npu_rotary_mul_backward); interleaved needs rotary_mode, 7.0.0+"),
        NpuMapping("attention", ("npu_fusion_attention",), "6.0.0", "native (npu_fusion_attention_grad)"),
        NpuMapping("sparse_attention", ("npu_fusion_attention",), "6.0.0",
                   "native; absorbed-MLA shapes use npu_sparse_flash_attention from 7.3.0 when present"),
        NpuMapping("lightning_indexer", ("npu_lightning_indexer",), "7.3.0", "none needed (integer output)"),
        NpuMapping("swiglu", ("npu_swiglu",), "6.0.0", "native (npu_swiglu_backward)"),
        NpuMapping("moe_route", ("npu_moe_gating_top_k",), "7.0.0",
                   "native (npu_moe_gating_top_k_backward from 26.1.0), else the reference backward"),
        NpuMapping("moe_permute", ("npu_moe_token_permute",), "7.2.0",
                   "native (npu_moe_token_permute_grad; npu_moe_token_permute_grad_v2 from 26.1.0)"),
        NpuMapping("moe_unpermute", ("npu_moe_token_unpermute",), "7.2.0", "native (npu_moe_token_unpermute_grad)"),
        NpuMapping("grouped_matmul", ("npu_grouped_matmul",), "7.0.0",
                   "slime autograd.Function: dx by a grouped matmul (group_type 0); dw by one (group_type 2) "
                   "from 26.0.0, per expert in torch before"),
    )
}

LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def has_kernel(name: str) -> bool:
    npu = torch_npu()
    if hasattr(npu, name):
        return True
    try:  # kernels registered only under torch.ops.npu
        getattr(torch.ops.npu, name)
        return True
    except (AttributeError, RuntimeError):
        return False


KERNEL_CALLS: dict[str, int] = {}  # kernel lookups by name; the probes check their inputs reached the kernel


def _kernel(name: str) -> Callable:
    KERNEL_CALLS[name] = KERNEL_CALLS.get(name, 0) + 1
    npu = torch_npu()
    fn = getattr(npu, name, None)
    return fn if fn is not None else getattr(torch.ops.npu, name)


_SOC: list[str] = []  # the process's SoC ("A2", "A3", "950PR", "950DT", ...), set by resolve()


def current_soc() -> str:
    if not _SOC:
        try:
            _SOC.append(soc_of(str(torch.npu.get_device_name())))
        except Exception:
            _SOC.append("unknown")
    return _SOC[0]


def _release() -> str | None:
    return release_of(str(getattr(torch_npu(), "__version__", "")))


def _at_least(release: str) -> bool:
    installed = _release()
    return installed is not None and release_key(installed) >= release_key(release)


def _unsupported(op: str, why: str) -> None:
    log_once(f"ops[npu].{op}: reference for inputs the kernel does not take ({why})")


def _host_offsets(cu: torch.Tensor, total: int, name: str) -> list[int]:
    """torch_npu's cumulative lengths: the end offset of each sequence, without the leading 0."""
    return seqlens_to_host(cu, total, name)[1:]


def _sequence_lengths(offsets: list[int]) -> list[int]:
    """Each sequence's token count from cumulative offsets that start with 0."""
    return [b - a for a, b in zip(offsets, offsets[1:])]


# --- norm / activation ----------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    # The kernel refuses 1-D input (x needs a leading dim besides gamma's).
    if weight is None or x.dim() < 2 or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    # The docstring requires gamma's dtype = x's: mixed pairs (bf16 x, fp32 weight) run in the promoted
    # dtype, which is also the reference's output dtype.
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if dtype not in FLOATS:
        return reference.rms_norm(x, weight, eps)
    y, _rstd = _kernel("npu_rms_norm")(x.to(dtype), weight.to(dtype), epsilon=float(eps))
    return y


def swiglu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in FLOATS or x.numel() == 0 or x.shape[-1] % 2:
        return reference.swiglu(x)
    return _kernel("npu_swiglu")(x.contiguous(), dim=-1)


# --- rotary ---------------------------------------------------------------------------------

# Rotary modes whose kernel path is on: "interleave" needs rotary_mode (7.0.0+); each mode's probe must pass.
_ROTARY_MODES: dict[str, bool] = {"half": True, "interleave": True}
_ROTARY_MODE_KW = [True]  # the kernel has the rotary_mode argument (7.0.0+); set by _prepare
_ROTARY_HEADS_LIMIT = 1000  # docstring: B, N < 1000 ("half"), B * N < 1000 ("interleave"); here B = 1


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> torch.Tensor:
    rd = check_rotary_dim(x, rotary_dim)
    mode = "interleave" if interleaved else "half"
    if x.dim() != 3 or rd >= 896 or x.dtype not in FLOATS or x.shape[0] == 0 or x.shape[1] >= _ROTARY_HEADS_LIMIT \
            or not _ROTARY_MODES[mode]:
        return reference.apply_rotary(x, cos, sin, rotary_dim, interleaved)
    c, s = rotary_pair_angles(x, cos, sin, rd)
    if c.dim() != 3 or c.shape[0] != x.shape[0] or c.shape[1] != 1:  # one angle row per token
        return reference.apply_rotary(x, cos, sin, rotary_dim, interleaved)
    # The kernel takes 4-D input only (every wheel's docstring): [T, H, D] goes in as BSND [1, T, H, D] with
    # cos/sin as 1S1D [1, T, 1, D], the one r1 layout both modes take for BSND. It rotates the whole last
    # dim and takes cos/sin at full width: "half" pairs (i, i+d/2) share an angle -> cat(c, c);
    # "interleave" pairs (2i, 2i+1) -> each angle repeated twice.
    widen = (lambda a: a.repeat_interleave(2, dim=-1)) if interleaved else (lambda a: torch.cat((a, a), dim=-1))
    r1 = widen(c.detach()).to(x.dtype).unsqueeze(0).contiguous()
    r2 = widen(s.detach()).to(x.dtype).unsqueeze(0).contiguous()
    xr = x[..., :rd].unsqueeze(0).contiguous()
    kernel = _kernel("npu_rotary_mul")
    out = (kernel(xr, r1, r2, rotary_mode=mode) if _ROTARY_MODE_KW[0] else kernel(xr, r1, r2)).squeeze(0)
    return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)


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


# --- MoE ------------------------------------------------------------------------------------


def _gating_takes(e: int, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool) -> bool:
    # Documented: sigmoid weights are always renormalised; E <= 2048; E / group_count > 2 and, aligned
    # up to 32, times group_count <= 2048; k <= E / group_count * k_group.
    if not norm_topk_prob or e > 2048 or e % n_group:
        return False
    per_group = e // n_group
    return per_group > 2 and -(-per_group // 32) * 32 * n_group <= 2048 and top_k <= per_group * topk_group


class _GatingWithReferenceBackward(torch.autograd.Function):
    """npu_moe_gating_top_k forward; backward recomputes the weights from the logits in torch (for
    torch_npu releases without npu_moe_gating_top_k_backward)."""

    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, scaling):
        y, idx, _ = _kernel("npu_moe_gating_top_k")(
            logits.detach(), top_k, bias=bias, k_group=topk_group, group_count=n_group, group_select_mode=1,
            renorm=0, norm_type=1, out_flag=False, routed_scaling_factor=scaling, eps=1e-20,
        )
        indices = idx.long()
        ctx.save_for_backward(logits, indices)
        ctx.scaling = scaling
        ctx.mark_non_differentiable(indices)
        return y, indices

    @staticmethod
    def backward(ctx, grad_weights, _grad_indices):
        logits, indices = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            w = torch.sigmoid(x).gather(1, indices)
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * ctx.scaling
            (grad,) = torch.autograd.grad(w, x, grad_weights)
        return grad, None, None, None, None, None


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or logits.shape[0] == 0 or not _gating_takes(logits.shape[1], n_group, topk_group, top_k, norm_topk_prob):
        return reference.moe_route(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob)
    x = logits.float()  # weights are float32 by contract; the kernel returns x's dtype
    b = None if bias is None else bias.float()
    if _NATIVE_GATING_BACKWARD[0]:
        y, idx, _ = _kernel("npu_moe_gating_top_k")(
            x, top_k, bias=b, k_group=topk_group, group_count=n_group, group_select_mode=1, renorm=0,
            norm_type=1, out_flag=True, routed_scaling_factor=float(routed_scaling_factor), eps=1e-20,
        )
        return y, idx.long()
    return _GatingWithReferenceBackward.apply(x, b, top_k, n_group, topk_group, float(routed_scaling_factor))


_NATIVE_GATING_BACKWARD = [False]


# Docstrings of every wheel read: permute takes bfloat16 tokens and int64 indices (topK <= 512); unpermute
# bfloat16 permuted tokens and probs, int64 sorted_indices. Other token dtypes use the reference (a cast
# to bfloat16 would round float32 / float16 tokens).
_PERMUTE_TOPK_MAX = 512


def moe_permute(tokens: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx2 = indices.unsqueeze(1) if indices.dim() == 1 else indices
    if tokens.dim() != 2 or idx2.dim() != 2 or tokens.dtype != torch.bfloat16 or tokens.shape[0] == 0 \
            or idx2.shape[0] != tokens.shape[0] or idx2.shape[1] > _PERMUTE_TOPK_MAX:
        return reference.moe_permute(tokens, indices)
    permuted, sorted_indices = _kernel("npu_moe_token_permute")(tokens, idx2.to(torch.int64))
    return permuted, sorted_indices.to(torch.int32)


def moe_unpermute(permuted: torch.Tensor, sort_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w2 = weights.unsqueeze(1) if weights.dim() == 1 else weights
    if permuted.dim() != 2 or permuted.dtype != torch.bfloat16 or w2.dim() != 2 or permuted.shape[0] == 0 \
            or permuted.shape[0] != w2.numel() or sort_map.numel() != w2.numel():
        return reference.moe_unpermute(permuted, sort_map, weights)
    # probs in bfloat16 as documented (autograd casts the gradient back to the weights' dtype).
    return _kernel("npu_moe_token_unpermute")(permuted, sort_map.to(torch.int64), probs=w2.to(torch.bfloat16))


_GMM_MAX_GROUPS = 1024  # docstring: group_type 0 takes at most 1024 groups
# dw by group_type 2 (groups along k, x transposed): the docstring lists group_type -1/0/1 only; the meta
# registration takes 2 from the 26.0.0 wheels (2.7.1.post4, 2.8.0.post4, 2.9.0.post2, 2.10.0) on. Before,
# and whenever the probe's dw check fails, dw is computed per expert in torch. Set by _prepare.
_GMM_DW_KERNEL = [True]


def _dw_per_expert(x: torch.Tensor, dy: torch.Tensor, group_list: torch.Tensor, experts: int) -> torch.Tensor:
    ends = [0] + [int(e) for e in group_list.tolist()]
    dw = x.new_zeros(experts, x.shape[1], dy.shape[1])
    for e in range(experts):
        if ends[e + 1] > ends[e]:
            dw[e] = x[ends[e]: ends[e + 1]].t() @ dy[ends[e]: ends[e + 1]]
    return dw


class _GroupedMatmul(torch.autograd.Function):
    """y = x @ w[e] per expert row block. npu_grouped_matmul has no autograd; dx is a grouped matmul too
    (group_type 0 = groups along m), dw one along k (group_type 2) where _GMM_DW_KERNEL allows."""

    @staticmethod
    def forward(ctx, x, w, group_list, empty_experts):
        gmm = _kernel("npu_grouped_matmul")
        y = gmm([x], [w], group_list=group_list, split_item=3, group_type=0, group_list_type=0)[0]
        ctx.save_for_backward(x, w, group_list, empty_experts)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, group_list, empty_experts = ctx.saved_tensors
        gmm = _kernel("npu_grouped_matmul")
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gmm([dy], [w.transpose(1, 2)], group_list=group_list, split_item=3, group_type=0, group_list_type=0)[0]
        if ctx.needs_input_grad[1] and not _GMM_DW_KERNEL[0]:
            dw = _dw_per_expert(x, dy, group_list, w.shape[0])
        elif ctx.needs_input_grad[1]:
            dw = gmm([x.t()], [dy], group_list=group_list, split_item=3, group_type=2, group_list_type=0)[0]
            # The kernel documents nothing for empty k-groups: make an expert without tokens get 0.
            dw = dw.masked_fill(empty_experts.view(-1, 1, 1), 0)
        return dx, dw, None, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    reference.check_grouped_matmul(x, w)
    if x.dtype not in FLOATS or w.dtype != x.dtype or x.shape[0] == 0 or w.shape[0] == 0 \
            or w.shape[0] > _GMM_MAX_GROUPS:
        return reference.grouped_matmul(x, w, tokens_per_expert)
    counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
    reference.tokens_per_expert_to_host(counts, w.shape[0], x.shape[0])  # one host sync: bad counts corrupt silently
    return _GroupedMatmul.apply(x, w, torch.cumsum(counts, 0), counts == 0)


IMPLEMENTATIONS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "apply_rotary": apply_rotary,
    "attention": attention,
    "sparse_attention": sparse_attention,
    "lightning_indexer": lightning_indexer,
    "swiglu": swiglu,
    "moe_route": moe_route,
    "moe_permute": moe_permute,
    "moe_unpermute": moe_unpermute,
    "grouped_matmul": grouped_matmul,
}


_PROBED: dict[str, str] = {}  # "op" / "op[mode]" -> '' (probe passed) or why it failed; once per process


def _probe_once(op_name: str, acc, kernel: str, mode: str = "default") -> str:
    key = op_name if mode == "default" else f"{op_name}[{mode}]"
    if key not in _PROBED:
        _PROBED[key] = probes.probe(op_name, IMPLEMENTATIONS[op_name], acc.device(), KERNEL_CALLS, kernel, mode)
    return _PROBED[key]


def _prepare(op_name: str, acc, version: str) -> None:
    """Release- and SoC-dependent switches inside a mapping, decided before its probe."""
    if op_name == "apply_rotary":
        _ROTARY_MODE_KW[0] = _at_least("7.0.0")
        _ROTARY_MODES["half"] = True
        _ROTARY_MODES["interleave"] = _ROTARY_MODE_KW[0]  # kernels before 7.0.0 only rotate "half"
    elif op_name == "grouped_matmul":
        _GMM_DW_KERNEL[0] = _at_least("26.0.0")
    elif op_name == "moe_route":
        _NATIVE_GATING_BACKWARD[0] = _at_least("26.1.0") and has_kernel("npu_moe_gating_top_k_backward")
        if not _NATIVE_GATING_BACKWARD[0]:
            log_once(f"ops[npu].moe_route: torch_npu {version} has no npu_moe_gating_top_k backward (needs "
                     f"{requirement('26.1.0')}); forward on the kernel, backward by the reference")
    elif op_name == "sparse_attention":
        _SFA_OK[0] = _at_least("7.3.0") and has_kernel("npu_sparse_flash_attention")
        if _SFA_OK[0]:
            if "sparse_attention_absorbed" not in _PROBED:
                _PROBED["sparse_attention_absorbed"] = probes.probe(
                    "sparse_attention_absorbed", sparse_attention, acc.device(), KERNEL_CALLS, "npu_sparse_flash_attention")
            why = _PROBED["sparse_attention_absorbed"]
            if why:
                _SFA_OK[0] = False
                log_once(f"ops[npu].sparse_attention: probe of torch_npu.npu_sparse_flash_attention (mode absorbed "
                         f"MLA, TND) on {current_soc()} failed: {why}; absorbed-MLA shapes use npu_fusion_attention "
                         f"per sequence")


def _modes(op_name: str) -> list[str]:
    """The probe modes the installed release has (interleave rotary needs rotary_mode)."""
    if op_name == "apply_rotary":
        return [m for m in probes.modes(op_name) if _ROTARY_MODES[m]]
    return list(probes.modes(op_name))


def _probe_modes(op_name: str, acc, kernel: str, soc: str) -> str:
    """Probe every mode; a failing mode is switched to the reference with one log line. '' when the
    kernel runs in at least one mode, else why not."""
    if op_name == "grouped_matmul":  # dw by group_type 2 (undocumented), else dw per expert in torch
        results = {"dw_group_type_2": _probe_once(op_name, acc, kernel, "dw_group_type_2")} if _GMM_DW_KERNEL[0] else {}
        if not results or results["dw_group_type_2"]:
            _GMM_DW_KERNEL[0] = False
            results["dw_per_expert"] = _probe_once(op_name, acc, kernel, "dw_per_expert")
            if not results["dw_per_expert"] and len(results) == 2:
                log_once(f"ops[npu].grouped_matmul: probe of torch_npu.npu_grouped_matmul (mode dw_group_type_2) on "
                         f"{soc} failed: {results['dw_group_type_2']}; dw per expert in torch")
                return ""
    else:
        results = {m: _probe_once(op_name, acc, kernel, m) for m in _modes(op_name)}
    failed = {m: why for m, why in results.items() if why}
    if failed and len(failed) == len(results):
        mode, why = next(iter(failed.items()))
        return f"probe of torch_npu.{kernel} (mode {mode}) on {soc} failed: {why}"
    for mode, why in failed.items():
        if op_name == "apply_rotary":
            _ROTARY_MODES[mode] = False
        log_once(f"ops[npu].{op_name}: probe of torch_npu.{kernel} (mode {mode}) on {soc} failed: {why}; "
                 f"{mode} uses the reference")
    return ""


def resolve(op_name: str, acc) -> DeviceOp | None:
    """Provider hook for slime.accelerator.ops: the Ascend implementation of `op_name`, or why not.
    Order: torch_npu imports; its release is at least the mapping's `since`; the kernels exist; the
    one-time probe passes on this SoC."""
    if op_name in kda_ops.OPS:  # GLM-5.3-Flash's KDA ops: sgl-kernel-npu kernels or the reference (kda_ops.py)
        if not _SOC:
            _SOC.append(soc_of(acc.device_name()))
        return kda_ops.resolve(op_name, current_soc(), lambda op, fn, kernel: _probe_kda(op, fn, acc, kernel))
    mapping = MAPPINGS.get(op_name)
    if mapping is None:
        return None  # no fused kernel worth it (token_log_probs: the chunked torch reference)
    try:
        npu = torch_npu()
    except Exception as e:
        return DeviceOp(None, "", f"import torch_npu failed: {type(e).__name__}: {e}")
    version = str(getattr(npu, "__version__", "unknown"))
    release = release_of(version)
    if release is None:
        return DeviceOp(None, "", f"torch_npu {version} is not in slime's release table "
                                  f"(slime/accelerator/ascend/support.py); {op_name} ({', '.join(mapping.kernels)}) "
                                  f"needs {mapping.requirement()}")
    if release_key(release) < release_key(mapping.since):
        return DeviceOp(None, "", f"torch_npu {version} is Ascend PyTorch {release}; {op_name} "
                                  f"({', '.join(mapping.kernels)}) needs {mapping.requirement()}")
    missing = [k for k in mapping.kernels if not has_kernel(k)]
    if missing:
        return DeviceOp(None, "", f"torch_npu {version} lacks {', '.join(missing)}; needs {mapping.requirement()}")
    if not _SOC:
        _SOC.append(soc_of(acc.device_name()))
    soc = current_soc()
    _prepare(op_name, acc, version)
    kernel = mapping.kernels[0]
    why = _probe_modes(op_name, acc, kernel, soc)
    if why:
        return DeviceOp(None, "", why)
    if not documented_on(kernel, soc):
        log_once(f"ops[npu].{op_name}: torch_npu.{kernel} is not documented for {soc}; its probe passed, using it")
    return DeviceOp(IMPLEMENTATIONS[op_name], "torch_npu." + kernel)


def _probe_kda(op_name: str, fn: Callable, acc, kernel: str) -> str:
    if op_name not in _PROBED:
        _PROBED[op_name] = probes.probe(op_name, fn, acc.device(), kda_ops.KERNEL_CALLS, kernel)
    return _PROBED[op_name]


def probe_results() -> tuple[dict[str, str], list[str]]:
    """The per-process probe results and SoC, for restore_probe_results (the simulator's tests reuse them)."""
    return dict(_PROBED), list(_SOC)


def restore_probe_results(saved: tuple[dict[str, str], list[str]]) -> None:
    _PROBED.update(saved[0])
    _SOC[:] = saved[1]


def forget_probes() -> None:
    """Forget the per-process probe results and SoC (tests switch simulated releases and SoCs)."""
    _PROBED.clear()
    _SOC.clear()
    _SFA_OK[0] = False
    _ROTARY_MODES.update(half=True, interleave=True)
    _GMM_DW_KERNEL[0] = True
