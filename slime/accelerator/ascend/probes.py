"""One-time probes of the Ascend op mappings: per op, mode and process, the mapping runs on a small input
on the device and its forward (and backward, where the op has one) is compared with slime's reference op
run in float64 on the host, before the mapping is put in the table.

Why: on 950-class SoCs torch_npu runs aclnn kernels only, and several kernels' docs do not list those
SoCs; and where the docstrings leave a convention open (the TND key / kv lengths of the indexer and the
sparse flash attention, grouped matmul's group_type 2) a kernel can be finite but wrong. The probe runs
the mapping itself (its input guards and argument conventions are what gets tried) on inputs it takes,
with more than one packed sequence of unequal length, from a private generator (the process's RNG
streams are untouched). Any error, a result or gradient outside the tolerance below, or inputs that never
reached the kernel mean: that mode uses the reference, with one log line naming the op, the mode and the
difference (ops.py).

Tolerance: elementwise |kernel - reference| <= atol + rtol * |reference| (TOLERANCES, per op, forward and
backward; bfloat16 inputs unless stated). Integer outputs must be equal; the indexer's selection is
compared by the reference scores of the selected keys (tie order is the kernel's).
"""

from __future__ import annotations

from typing import Callable

import torch

from slime.accelerator.ops import reference, reference_op

BF16 = torch.bfloat16
# (rtol, atol) forward, (rtol, atol) backward. bfloat16 has 8 significant bits (relative spacing 2**-7):
# 2e-2 allows a few roundings of inputs, outputs and accumulators; gradients pass through one more.
TOLERANCES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "rms_norm": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "apply_rotary": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "attention": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "sparse_attention": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "sparse_attention_absorbed": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "lightning_indexer": ((1e-2, 1e-2), (0.0, 0.0)),  # scores of the selected keys (float64 reference scores)
    "swiglu": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "moe_route": ((1e-4, 1e-5), (1e-3, 1e-5)),  # float32 logits
    "moe_permute": ((0.0, 0.0), (2e-2, 2e-2)),  # a copy: exact; the gradient sums bfloat16 copies
    "moe_unpermute": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "grouped_matmul": ((2e-2, 2e-2), (5e-2, 5e-2)),
    "causal_conv1d": ((2e-2, 2e-2), (5e-2, 5e-2)),  # bfloat16 x; the float32 weight goes in as bfloat16
    "kda_gate": ((1e-2, 1e-3), (1e-2, 1e-3)),  # bfloat16 f, float32 math and output
}
# The modes each op is probed in (ops.py runs one probe per mode and switches a failing mode off).
MODES: dict[str, tuple[str, ...]] = {
    "apply_rotary": ("half", "interleave"),
    "attention": ("TND",),
    "sparse_attention": ("BSND per sequence",),
    "lightning_indexer": ("TND",),
}


def modes(op: str) -> tuple[str, ...]:
    return MODES.get(op, ("default",))


def _inputs(op: str, mode: str, device: torch.device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1234)

    def randn(*shape, dtype=BF16, grad=True):
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    def ints(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    cu = ints(0, 3, 8)  # two packed sequences of unequal length
    if op == "rms_norm":
        return (randn(4, 64), randn(64), 1e-6), {}
    if op == "apply_rotary":  # [T, H, D] with rotary_dim < D (a partial rotation, as MLA's rope part)
        return (randn(8, 3, 64), randn(8, 24, grad=False), randn(8, 24, grad=False), 48), \
            {"interleaved": mode == "interleave"}
    if op == "attention":
        return (randn(8, 2, 64), randn(8, 2, 64), randn(8, 2, 64), cu, cu), {"causal": True}
    idx = torch.tensor([[0, -1], [0, 1], [1, 2], [0, -1], [0, 1], [1, 2], [0, 3], [2, 4]], dtype=torch.int32,
                       device=device)  # positions within each query's sequence
    if op == "sparse_attention":
        return (randn(8, 2, 64), randn(8, 2, 64), randn(8, 2, 64), idx, cu, cu), {"causal": True}
    if op == "sparse_attention_absorbed":  # MLA with absorbed weights: one latent head, v = k's first 512
        k = randn(8, 1, 576)
        return (randn(8, 2, 576), k, k[..., :512], idx, cu, cu), {"causal": True}
    if op == "lightning_indexer":
        return (randn(8, 8, 128, grad=False), randn(8, 128, grad=False), randn(8, 8, grad=False), cu, cu, 2), {}
    if op == "swiglu":
        return (randn(4, 64),), {}
    if op == "moe_route":
        return (randn(4, 16, dtype=torch.float32), randn(16, dtype=torch.float32, grad=False), 2), \
            {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}
    if op == "moe_permute":
        return (randn(4, 8), torch.tensor([[0, 1], [2, 1], [3, 0], [1, 2]], dtype=torch.int32, device=device)), {}
    if op == "moe_unpermute":
        return (randn(8, 8), ints(5, 0, 3, 1, 7, 2, 6, 4), randn(4, 2, dtype=torch.float32)), {}
    if op == "causal_conv1d":  # [T, C] with a float32 [C, K] weight (the model keeps it float32), K = 4
        return (randn(8, 64), randn(64, 4, dtype=torch.float32), cu), {"activation": "silu"}
    if op == "kda_gate":  # f [T, H, D]; A_log [H], dt_bias [H*D] float32; GLM-5.3-Flash's lower bound
        return (randn(8, 2, 16), randn(2, dtype=torch.float32), randn(32, dtype=torch.float32), -5.0), {}
    if op == "grouped_matmul":
        return (randn(6, 8), randn(3, 8, 4), torch.tensor([2, 0, 4], dtype=torch.int64, device=device)), {}
    raise KeyError(op)


def _flat(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (list, tuple)) else []


def _host_float64(args: tuple) -> tuple:
    """The probe inputs as float64 host leaves (views of another input stay views, as k / v in MLA)."""
    out: list = []
    for a in args:
        if not torch.is_tensor(a):
            out.append(a)
            continue
        base = next((i for i, b in enumerate(args[: len(out)]) if torch.is_tensor(b) and b._base is None
                     and a._base is b), None)
        if base is not None:  # v = k[..., :512]: the same slice of k's host copy
            out.append(out[base][..., : a.shape[-1]])
        elif a.is_floating_point():
            out.append(a.detach().cpu().double().requires_grad_(a.requires_grad))
        else:
            out.append(a.detach().cpu())
    return tuple(out)


def _excess(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """max |got - want| / (atol + rtol |want|): <= 1 is within tolerance; inf for a shape mismatch."""
    if got.shape != want.shape:
        return float("inf")
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    diff = (got - want).abs()
    bound = atol + rtol * want.abs()
    exact = bound == 0
    if bool(exact.any()) and bool((diff[exact] > 0).any()):
        return float("inf")
    return float((diff[~exact] / bound[~exact]).max()) if bool((~exact).any()) else 0.0


def _indexer_scores(q, k, weights, cu_q, cu_k, scale) -> list[torch.Tensor]:
    """float64 indexer scores per query row over its sequence's keys (causal, bottom-right), -inf masked."""
    k2 = k[:, 0] if k.dim() == 3 else k
    rows = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks, ws = q[cq[b]: cq[b + 1]], k2[ck[b]: ck[b + 1]], weights[cq[b]: cq[b + 1]]
        s = torch.einsum("shd,td->sht", qs, ks).clamp_min(0)
        s = torch.einsum("sh,sht->st", ws, s) * scale
        sq, sk = s.shape
        rows.extend(s.masked_fill(~reference.causal_mask(sq, sk, s.device), float("-inf")))
    return rows


def _indexer_excess(got: torch.Tensor, want: torch.Tensor, args: tuple, tol: tuple[float, float]) -> float:
    """Both selections scored by the float64 reference scores, sorted: ties may pick other keys."""
    q, k, w, cu_q, cu_k = args[:5]
    scale = reference.default_scale(q, None)
    rows = _indexer_scores(q.detach().double(), k.detach().double(), w.detach().double(), cu_q, cu_k, scale)
    if got.shape != want.shape:
        return float("inf")
    worst = 0.0
    for row, g, r in zip(rows, got.cpu().long(), want.cpu().long()):
        if bool((g >= row.numel()).any()) or bool((g < -1).any()):
            return float("inf")
        a, b = (torch.sort(torch.where(i < 0, float("-inf"), row[i.clamp_min(0)]), descending=True).values for i in (g, r))
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            return float("inf")
        fin = ~torch.isinf(a)
        worst = max(worst, _excess(a[fin], b[fin], *tol))
    return worst


def _canonical(op: str, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    if op == "moe_route":  # (weights, indices): order within a token's top-k is the kernel's
        w, idx = outs
        order = idx.argsort(dim=-1)
        return [w.gather(-1, order), idx.gather(-1, order)]
    return outs


def probe(op: str, fn: Callable, device: torch.device, calls: dict[str, int], kernel: str,
          mode: str = "default") -> str:
    """'' when `fn` ran `kernel` forward (and backward) in `mode` and agreed with the float64 reference,
    else why not. `calls` counts kernel calls by name (ops._kernel updates it)."""
    try:
        args, kwargs = _inputs(op, mode, device)
        ref_fn = reference_op(op.replace("_absorbed", ""))
        (rtol, atol), (grtol, gatol) = TOLERANCES[op]
        before = calls.get(kernel, 0)
        with torch.enable_grad():
            got = _flat(fn(*args, **kwargs))
            if calls.get(kernel, 0) == before:
                return f"probe inputs did not reach {kernel}"
            ref_args = _host_float64(args)
            want = _flat(ref_fn(*ref_args, **kwargs))
            if len(got) != len(want):
                return f"{len(got)} outputs, the reference {len(want)}"
            if op == "lightning_indexer":
                excess = _indexer_excess(got[0], want[0], ref_args, (rtol, atol))
            else:
                excess = max(_excess(a, b.to(a.dtype) if not a.is_floating_point() else b, rtol, atol)
                             for a, b in zip(_canonical(op, got), _canonical(op, want)))
            if excess > 1:
                return _difference("output", got, want, op, rtol, atol)
            leaves = [(a, r) for a, r in zip(args, ref_args) if torch.is_tensor(a) and a.requires_grad and a.is_leaf]
            pairs = [(a, b) for a, b in zip(got, want) if a.is_floating_point() and a.requires_grad]
            if leaves and pairs:
                g = torch.Generator().manual_seed(99)
                cots = [torch.randn(b.shape, generator=g, dtype=torch.float64) for _, b in pairs]
                grads = torch.autograd.grad(sum((a.double().cpu() * c).sum() for (a, _), c in zip(pairs, cots)),
                                            [a for a, _ in leaves], allow_unused=True)
                ref_grads = torch.autograd.grad(sum((b * c).sum() for (_, b), c in zip(pairs, cots)),
                                                [r for _, r in leaves], allow_unused=True)
                for i, (gk, gr) in enumerate(zip(grads, ref_grads)):
                    gk = torch.zeros_like(gr) if gk is None and gr is not None else gk
                    gr = torch.zeros_like(gk) if gr is None and gk is not None else gr
                    if gk is not None and _excess(gk, gr, grtol, gatol) > 1:
                        d = float((gk.detach().cpu().double() - gr).abs().max()) if gk.shape == gr.shape else float("inf")
                        return (f"gradient of input {i} differs from the reference by up to {d:.3g} "
                                f"(tolerance {gatol:g} + {grtol:g}*|ref|)")
        return ""
    except Exception as e:  # the kernel's own error, whatever its type
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"


def _difference(what: str, got: list, want: list, op: str, rtol: float, atol: float) -> str:
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return f"{what} shape {tuple(a.shape)} differs from the reference's {tuple(b.shape)}"
        if not bool(torch.isfinite(a.detach().float()).all()) if a.is_floating_point() else False:
            return f"non-finite {what}"
        worst = max(worst, float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max()))
    what = "selected keys" if op == "lightning_indexer" else what
    return f"{what} differs from the reference by up to {worst:.3g} (tolerance {atol:g} + {rtol:g}*|ref|)"
