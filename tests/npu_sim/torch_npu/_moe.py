"""SIMULATED npu_moe_gating_top_k, npu_moe_token_permute/unpermute, npu_grouped_matmul."""

from __future__ import annotations

import torch

from ._common import at_least, check, doc, f64, fail, require_soc, without_derivative

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32,
           "int64": torch.int64}


def _documented(op: str, key: str, fallback: tuple) -> tuple:
    """The dtypes the simulated wheel's docstring lists for one argument (`fallback` where it says nothing)."""
    names = doc(op).get(key)
    return tuple(_DTYPES[n] for n in names) if names else fallback


def _check_dtype(op: str, name: str, t: torch.Tensor, key: str, fallback: tuple) -> None:
    allowed = _documented(op, key, fallback)
    check(t.dtype in allowed, op, f"{name} must be {'/'.join(str(d).replace('torch.', '') for d in allowed)} "
                                  f"(docstring), got {t.dtype}")


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """norm_type 1 = sigmoid, 0 = softmax; bias only for the choice; group score = max (mode 0) or sum of
    top-2 (mode 1); stable descending sorts (lower index wins ties); sigmoid weights divided by
    (sum + eps); times routed_scaling_factor. -> (y in x.dtype, expert_idx int32, norm_out float32)."""
    op = "npu_moe_gating_top_k"
    require_soc(op)
    check(x.dim() == 2, op, f"x must be 2-D, got {x.dim()}-D")
    check(x.dtype in _FLOATS, op, f"unsupported dtype {x.dtype}")
    e = x.shape[1]
    check(e <= 2048, op, f"expert count must be <= 2048, got {e}")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == e, op, f"bias must be [E={e}]")
        check(bias.dtype == x.dtype, op, f"bias dtype {bias.dtype} must equal x dtype {x.dtype}")
    check(group_count > 0 and e % group_count == 0, op, f"E={e} must be divisible by group_count={group_count}")
    per_group = e // group_count
    check(per_group > 2, op, f"E / group_count must be > 2, got {per_group}")
    check(-(-per_group // 32) * 32 * group_count <= 2048, op, "E/group_count aligned to 32, times group_count, must be <= 2048")
    check(1 <= k_group <= group_count, op, f"need 1 <= k_group={k_group} <= group_count={group_count}")
    check(1 <= k <= per_group * k_group, op, f"need 1 <= k={k} <= E/group_count*k_group={per_group * k_group}")
    check(renorm == 0, op, "only renorm=0 is supported")
    check(norm_type in (0, 1) and group_select_mode in (0, 1), op, "norm_type and group_select_mode must be 0 or 1")
    xf = x.to(torch.float32)
    norm = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, dim=-1)
    with torch.no_grad():
        choice = norm + (bias.to(torch.float32) if bias is not None else 0.0)
        if group_count > 1:
            grouped = choice.view(-1, group_count, per_group)
            if group_select_mode == 0:
                gscore = grouped.amax(dim=-1)
            else:
                gscore = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(dim=-1)
            keep = torch.argsort(-gscore, dim=-1, stable=True)[:, :k_group]
            drop = torch.ones_like(gscore, dtype=torch.bool).scatter(1, keep, False)
            choice = choice.masked_fill(drop.repeat_interleave(per_group, dim=1), float("-inf"))
        idx = torch.argsort(-choice, dim=-1, stable=True)[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = (y * routed_scaling_factor).to(x.dtype)
    norm_out = norm.detach() if out_flag else x.new_empty(0, dtype=torch.float32)
    if not at_least("26.1.0"):
        y = without_derivative(op, y.detach(), x)
    elif not out_flag and y.requires_grad:
        y = without_derivative(op + " (backward needs norm_out: call with out_flag=True)", y.detach(), x)
    return y, idx.to(torch.int32), norm_out


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """sorted_indices = argsort(argsort(flatten(indices))) (stable): the destination row of copy i;
    permuted[sorted_indices[i]] = tokens[i // topK]. -> (permuted_tokens, sorted_indices int32)."""
    op = "npu_moe_token_permute"
    check(not padded_mode, op, "padded_mode=True is not supported")
    check(tokens.dim() == 2, op, "tokens must be 2-D")
    _check_dtype(op, "tokens", tokens, "tokens_dtypes", _FLOATS)
    check(indices.dim() in (1, 2) and indices.shape[0] == tokens.shape[0], op, "indices must be [T] or [T, topK]")
    _check_dtype(op, "indices", indices, "indices_dtypes", (torch.int32, torch.int64))
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    flat = indices.reshape(-1)
    first = torch.argsort(flat, stable=True)
    sorted_indices = torch.argsort(first, stable=True)
    n_out = flat.numel() if not num_out_tokens else min(int(num_out_tokens), flat.numel())
    permuted = tokens.index_select(0, first // topk)[:n_out]
    if not at_least("7.2.0"):
        permuted = without_derivative(op, permuted.detach(), tokens)
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*topK + k]] (probs None = 1)."""
    op = "npu_moe_token_unpermute"
    check(not padded_mode, op, "padded_mode=True is not supported")
    check(permuted_tokens.dim() == 2, op, "permuted_tokens must be 2-D")
    _check_dtype(op, "permuted_tokens", permuted_tokens, "permuted_tokens_dtypes", _FLOATS)
    check(sorted_indices.dim() == 1, op, "sorted_indices must be 1-D")
    _check_dtype(op, "sorted_indices", sorted_indices, "sorted_indices_dtypes", (torch.int32,))
    if probs is not None:
        check(probs.dim() == 2 and probs.numel() == sorted_indices.numel(), op, "probs must be [T, topK]")
        _check_dtype(op, "probs", probs, "probs_dtypes", (permuted_tokens.dtype,))
        check(probs.dtype == permuted_tokens.dtype, op, f"probs dtype {probs.dtype} must equal permuted_tokens dtype")
        t, topk = probs.shape
    else:
        topk = 1
        t = sorted_indices.numel()
    check(bool((sorted_indices < permuted_tokens.shape[0]).all()) and bool((sorted_indices >= 0).all()), op,
          "sorted_indices out of range for permuted_tokens")
    copies = f64(permuted_tokens).index_select(0, sorted_indices.long()).view(t, topk, permuted_tokens.shape[1])
    w = f64(probs).unsqueeze(-1) if probs is not None else 1.0
    out = (copies * w).sum(dim=1).to(permuted_tokens.dtype)
    if not at_least("7.2.0"):
        out = without_derivative(op, out.detach(), permuted_tokens, probs)
    return out


def _group_bounds(op, group_list, group_list_type, groups, extent):
    check(isinstance(group_list, torch.Tensor), op, "with group_type set, group_list must be a Tensor")
    check(group_list.dim() == 1 and group_list.dtype == torch.int64, op, "group_list must be a 1-D int64 tensor")
    check(group_list.shape[0] == groups, op, f"group_list must have one entry per group ({groups}), got {group_list.shape[0]}")
    vals = [int(v) for v in group_list.tolist()]
    check(all(v >= 0 for v in vals), op, "group_list must be non-negative")
    if group_list_type == 0:
        check(all(b >= a for a, b in zip(vals, vals[1:])), op, "group_list_type=0 takes non-decreasing cumulative sums")
        ends = vals
    elif group_list_type == 1:
        check(len(vals) != 1, op, "group_list_type=1 (counts) cannot have length 1")
        ends = list(torch.tensor(vals).cumsum(0).tolist())
    else:
        raise fail(op, f"group_list_type {group_list_type} is not simulated")
    check(ends[-1] == extent, op, f"group_list[-1] must equal the grouped axis ({extent}), got {ends[-1]}")
    return list(zip([0] + ends[:-1], ends))


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """Grouped matmul; no autograd (wrap it). group_type 0: x [M, K] row groups times weight [E, K, N]
    -> [M, N]; 2: x [K, M] and weight [M, N] grouped along M -> [E, K, N]. Rows/groups the group_list
    does not define are left undefined (NaN here)."""
    op = "npu_grouped_matmul"
    check(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight must be lists of tensors")
    check(all(a is None for a in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                  activation_input, activation_quant_scale, activation_quant_offset)), op,
          "quantization / bias inputs are not simulated")
    check(act_type == 0, op, "fused activation is not simulated")
    if group_type is None or group_type == -1:
        check(group_list is None and len(x) == len(weight), op, "without grouping, pass equal-length x and weight lists")
        outs = [f64(a) @ f64(b) for a, b in zip(x, weight)]
        return [without_derivative(op, o.to(a.dtype), a, b) for o, a, b in zip(outs, x, weight)]
    check(len(x) == 1 and len(weight) == 1, op, "the simulator covers one x and one weight tensor with grouping")
    xt, wt = x[0], weight[0]
    check(xt.dtype == wt.dtype and xt.dtype in _FLOATS, op, "x and weight must share a float dtype")
    check(xt.dim() == 2, op, "x must be 2-D when grouped")
    if group_type == 0:
        check(split_item in (2, 3), op, "one x with a 3-D weight and group_type=0 needs split_item 2 or 3")
        check(wt.dim() == 3 and wt.shape[1] == xt.shape[1], op, f"weight must be [E, K={xt.shape[1]}, N], got {tuple(wt.shape)}")
        limit = doc(op).get("group_type0_max_groups") or 1024
        check(wt.shape[0] <= limit, op, f"group_type=0 takes at most {limit} groups (docstring), got {wt.shape[0]}")
        bounds = _group_bounds(op, group_list, group_list_type, wt.shape[0], xt.shape[0])
        y = torch.full((xt.shape[0], wt.shape[2]), float("nan"), dtype=torch.float64, device=xt.device)
        for e, (a, b) in enumerate(bounds):
            y[a:b] = f64(xt[a:b]) @ f64(wt[e])
    elif group_type == 2:
        # Undocumented (the docstring lists -1/0/1); the meta registration takes it from the 26.0.0 wheels.
        check(at_least("26.0.0"), op, "group_type 2 is not supported by this release (meta: -1 and 0 only)")
        check(split_item == 3, op, "group_type=2 (grouped k) needs split_item=3")
        check(wt.dim() == 2 and wt.shape[0] == xt.shape[1], op, f"need x [K, M] and weight [M, N]; got {tuple(xt.shape)}, {tuple(wt.shape)}")
        groups = group_list.shape[0] if isinstance(group_list, torch.Tensor) else 0
        bounds = _group_bounds(op, group_list, group_list_type, groups, xt.shape[1])
        y = torch.full((groups, xt.shape[0], wt.shape[1]), float("nan"), dtype=torch.float64, device=xt.device)
        for e, (a, b) in enumerate(bounds):
            if b > a:  # an empty k-group's output is not documented: left NaN
                y[e] = f64(xt[:, a:b]) @ f64(wt[a:b])
    else:
        raise fail(op, f"group_type {group_type} is not supported (use -1, 0 or 2)")
    with torch.no_grad():
        out = y.to(xt.dtype)
    return [without_derivative(op, out, xt, wt)]


def npu_grouped_matmul_6_0(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, group_list=None, split_item=0, output_dtype=None):
    """Ascend PyTorch 6.0.0's signature: group_list is a host int list of cumulative row ends, weights
    are a list of 2-D tensors (one per group); there is no group_type / group_list_type."""
    op = "npu_grouped_matmul"
    check(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight must be lists of tensors")
    check(all(a is None for a in (bias, scale, offset, antiquant_scale, antiquant_offset)), op,
          "quantization / bias inputs are not simulated")
    check(all(w.dim() == 2 for w in weight), op, "each weight must be 2-D in this release")
    if group_list is None:
        check(len(x) == len(weight), op, "without group_list, pass equal-length x and weight lists")
        return [without_derivative(op, (f64(a) @ f64(b)).to(a.dtype), a, b) for a, b in zip(x, weight)]
    check(isinstance(group_list, (list, tuple)) and all(isinstance(v, int) for v in group_list), op,
          "group_list must be a host list of ints in this release")
    check(len(x) == 1 and len(group_list) == len(weight), op, "one x, one group_list entry per weight")
    xt = x[0]
    check(group_list[-1] == xt.shape[0], op, f"group_list[-1] must equal the rows of x ({xt.shape[0]})")
    bounds = list(zip([0] + list(group_list[:-1]), group_list))
    outs = [f64(xt[a:b]) @ f64(w) for (a, b), w in zip(bounds, weight)]
    if split_item in (2, 3):
        return [without_derivative(op, torch.cat(outs).to(xt.dtype), xt, *weight)]
    return [without_derivative(op, o.to(xt.dtype), xt, *weight) for o in outs]
