"""Ascend mappings of the MoE ops: routing (npu_moe_gating_top_k), token permute / unpermute
(npu_moe_token_permute / _unpermute) and the experts' grouped matmul (npu_grouped_matmul). Each calls the
reference for inputs its kernel does not take."""

from __future__ import annotations

import torch

from slime.accelerator.ascend.kernels import FLOATS, _kernel
from slime.accelerator.ops import reference

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
