"""One-time probes of the Ascend op mappings: a tiny forward (and backward where the op has one) per op
and process, before the op is put in the table.

On 950-class SoCs torch_npu runs aclnn kernels only, and several kernels' docs do not list those SoCs:
a missing kernel would fail at its first call, in the middle of a training step. The probe runs the
mapping itself (so its input guards and argument conventions are what gets tried) on inputs it takes,
on the current device, with a private generator (the process's RNG streams are untouched). Any error,
a non-finite result, or inputs that never reached the kernel mean: use the reference, with one log line
naming the op, the SoC and the error.
"""

from __future__ import annotations

from typing import Callable

import torch

BF16 = torch.bfloat16


def _inputs(op: str, device: torch.device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1234)

    def randn(*shape, dtype=BF16, grad=True):
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    def ints(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    cu = ints(0, 2, 6)  # two packed sequences of unequal length
    if op == "rms_norm":
        return (randn(4, 64), randn(64), 1e-6), {}
    if op == "apply_rotary":
        return (randn(6, 2, 64), randn(6, 32, grad=False), randn(6, 32, grad=False)), {}
    if op == "attention":
        return (randn(6, 2, 64), randn(6, 2, 64), randn(6, 2, 64), cu, cu), {"causal": True}
    if op == "sparse_attention":
        idx = torch.tensor([[0, -1], [0, 1], [0, -1], [0, 1], [1, 2], [2, 3]], dtype=torch.int32, device=device)
        return (randn(6, 2, 64), randn(6, 2, 64), randn(6, 2, 64), idx, cu, cu), {"causal": True}
    if op == "sparse_attention_absorbed":  # MLA with absorbed weights: one latent head, v = k's first 512
        k = randn(6, 1, 576)
        idx = torch.tensor([[0, -1], [0, 1], [0, -1], [0, 1], [1, 2], [2, 3]], dtype=torch.int32, device=device)
        return (randn(6, 2, 576), k, k[..., :512], idx, cu, cu), {"causal": True}
    if op == "lightning_indexer":
        return (randn(6, 8, 128, grad=False), randn(6, 128, grad=False), randn(6, 8, grad=False), cu, cu, 2), {}
    if op == "swiglu":
        return (randn(4, 64),), {}
    if op == "moe_route":
        return (randn(4, 16, dtype=torch.float32), randn(16, dtype=torch.float32, grad=False), 2), \
            {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}
    if op == "moe_permute":
        return (randn(4, 8), torch.tensor([[0, 1], [2, 1], [3, 0], [1, 2]], dtype=torch.int32, device=device)), {}
    if op == "moe_unpermute":
        return (randn(8, 8), ints(5, 0, 3, 1, 7, 2, 6, 4), randn(4, 2, dtype=torch.float32)), {}
    if op == "grouped_matmul":
        return (randn(6, 8), randn(3, 8, 4), torch.tensor([2, 0, 4], dtype=torch.int64, device=device)), {}
    raise KeyError(op)


def _flat(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (list, tuple)) else []


def probe(op: str, fn: Callable, device: torch.device, calls: dict[str, int], kernel: str) -> str:
    """'' when `fn` ran `kernel` forward (and backward) on tiny inputs with finite results, else why not.
    `calls` counts kernel calls by name (ops._kernel updates it)."""
    try:
        args, kwargs = _inputs(op, device)
        before = calls.get(kernel, 0)
        with torch.enable_grad():
            outs = _flat(fn(*args, **kwargs))
            floats = [o for o in outs if o.is_floating_point()]
            if not all(bool(torch.isfinite(o.float()).all()) for o in floats):
                return "non-finite result"
            leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
            graded = [o for o in floats if o.requires_grad]
            if leaves and graded:
                grads = torch.autograd.grad(sum(o.float().sum() for o in graded), leaves, allow_unused=True)
                if not all(g is None or bool(torch.isfinite(g.float()).all()) for g in grads):
                    return "non-finite gradient"
        if calls.get(kernel, 0) == before:
            return f"probe inputs did not reach {kernel}"
        return ""
    except Exception as e:  # the kernel's own error, whatever its type
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"
