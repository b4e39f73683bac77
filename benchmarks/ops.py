"""Benchmark each op: the accelerator's implementation vs the reference on the same inputs.

    python benchmarks/ops.py                      # detected accelerator; small sizes on CPU
    python benchmarks/ops.py --size large --ops attention,grouped_matmul
    python benchmarks/ops.py --npu-sim            # Ascend glue on the torch_npu simulator (CPU)

Prints per op: what implements it, reference and device time (forward, plus backward where the op is
differentiable), the speed ratio reference/device, and the error: max |device - reference| / max(1, max
|reference|) for float outputs, the share of rows whose index sets differ for index outputs (lightning
indexer: bf16 near-ties at the top-k cut may legitimately differ).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from slime.accelerator import get_accelerator  # noqa: E402
from slime.accelerator.ops import OP_NAMES, reference, reference_op  # noqa: E402

SIZES = {  # tokens, hidden, heads, experts, vocab
    "small": dict(t=256, h=512, heads=4, e=32, v=4096, seqs=2, topk=16),
    "large": dict(t=4096, h=4096, heads=16, e=256, v=151552, seqs=4, topk=512),
}


@dataclass
class Case:
    make: Callable[..., tuple[tuple, dict]]  # (device, dtype, size) -> (args, kwargs)
    grad_args: tuple[int, ...] = ()  # positions of args that get gradients


def _cu(t: int, seqs: int, dev) -> torch.Tensor:
    # Unequal lengths (1 : 2 : ... : seqs): a kernel that counts positions from the pack's start instead of
    # each sequence's (the undocumented TND index base of npu_lightning_indexer) shows up as a mismatch.
    weights = list(range(1, seqs + 1))
    lens = [max(1, t * w // sum(weights)) for w in weights]
    lens[-1] += t - sum(lens)
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)


def _cases() -> dict[str, Case]:
    def rms(dev, dt, s):
        return (torch.randn(s["t"], s["h"], device=dev, dtype=dt), torch.rand(s["h"], device=dev, dtype=dt), 1e-6), {}

    def rotary(dev, dt, s):
        x = torch.randn(s["t"], s["heads"], 128, device=dev, dtype=dt)
        ang = torch.arange(s["t"], device=dev)[:, None].float() * torch.rand(32, device=dev)
        emb = torch.cat((ang, ang), -1)
        return (x, emb.cos().to(dt), emb.sin().to(dt), 64, True), {}

    def attn(dev, dt, s):
        hq = s["heads"]
        q = torch.randn(s["t"], hq, 192, device=dev, dtype=dt)
        k = torch.randn(s["t"], max(1, hq // 4), 192, device=dev, dtype=dt)
        v = torch.randn(s["t"], max(1, hq // 4), 128, device=dev, dtype=dt)
        cu = _cu(s["t"], s["seqs"], dev)
        return (q, k, v, cu, cu), {}

    def sparse(dev, dt, s):
        (q, k, v, cu, _), _ = attn(dev, dt, s)
        k = torch.randn(q.shape[0], q.shape[1], 192, device=dev, dtype=dt)
        v = torch.randn(q.shape[0], q.shape[1], 128, device=dev, dtype=dt)
        per = s["t"] // s["seqs"]
        pos = torch.arange(s["t"], device=dev) - (cu[:-1].repeat_interleave(cu.diff()).long())
        idx = (torch.rand(s["t"], s["topk"], device=dev) * (pos[:, None] + 1)).long().clamp_max(per - 1)
        return (q, k, v, idx.to(torch.int32), cu, cu), {}

    def indexer(dev, dt, s):
        q = torch.randn(s["t"], 32 if s is SIZES["large"] else 8, 128, device=dev, dtype=dt)
        k = torch.randn(s["t"], 128, device=dev, dtype=dt)
        w = torch.randn(s["t"], q.shape[1], device=dev, dtype=dt) * q.shape[1] ** -0.5
        cu = _cu(s["t"], s["seqs"], dev)
        return (q, k, w, cu, cu, s["topk"]), {}

    def kpool_indexer(dev, dt, s):  # GLM-5.3-Flash: pools of 16 keys, the incomplete tail always selected
        (q, k, w, cu, _, topk), _ = indexer(dev, dt, s)
        gate, ape = torch.randn_like(k), torch.randn(16, k.shape[-1], device=dev, dtype=dt)
        return (q, k, gate, ape, w, cu, cu, max(16, topk // 16 * 16), 16, True), {}

    def kda(dev, dt, s):  # GLM-5.3-Flash's KDA: per-channel log-decay above the lower bound -5
        shape = (s["t"], s["heads"], 128 if s is SIZES["large"] else 64)
        q, k, v = (torch.randn(shape, device=dev, dtype=dt) for _ in range(3))
        g = -5.0 * torch.sigmoid(torch.randn(shape, device=dev))
        return (q, k, v, g, torch.rand(shape[:2], device=dev, dtype=dt), _cu(s["t"], s["seqs"], dev)), {}

    def causal_conv1d(dev, dt, s):  # KDA's short convolutions: 4 taps over q, k and v channels, float32 weights
        channels = 3 * s["heads"] * 128
        x = torch.randn(s["t"], channels, device=dev, dtype=dt)
        return (x, torch.randn(channels, 4, device=dev) * 0.5, _cu(s["t"], s["seqs"], dev)), {}

    def kda_gate(dev, dt, s):
        f = torch.randn(s["t"], s["heads"], 128, device=dev, dtype=dt)
        return (f, torch.rand(s["heads"], device=dev), torch.randn(s["heads"] * 128, device=dev), -5.0), {}

    def fp8_quantize(dev, dt, s):  # an expert's weight with partial [128, 128] blocks, as the weight sync sends it
        return (torch.randn(s["h"] + 64, s["h"] // 2 + 32, device=dev, dtype=dt), (128, 128)), {}

    def swiglu(dev, dt, s):
        return (torch.randn(s["t"], 2 * s["h"], device=dev, dtype=dt),), {}

    def route(dev, dt, s):
        logits = torch.randn(s["t"], s["e"], device=dev, dtype=torch.float32)
        return (logits, torch.randn(s["e"], device=dev) * 0.1, 8, 8, 4, 2.5, True), {}

    def permute(dev, dt, s):
        idx = torch.stack([torch.randperm(s["e"], device=dev)[:8] for _ in range(s["t"])])
        return (torch.randn(s["t"], s["h"], device=dev, dtype=dt), idx), {}

    def unpermute(dev, dt, s):
        (tokens, idx), _ = permute(dev, dt, s)
        permuted, sort_map = reference.moe_permute(tokens, idx)
        return (permuted, sort_map, torch.rand(s["t"], 8, device=dev)), {}

    def gmm(dev, dt, s):
        counts = torch.bincount(torch.randint(0, s["e"], (s["t"] * 8,), device=dev), minlength=s["e"])
        inter = s["h"] // 4
        return (torch.randn(s["t"] * 8, s["h"], device=dev, dtype=dt),
                torch.randn(s["e"], s["h"], inter, device=dev, dtype=dt) * s["h"] ** -0.5, counts), {}

    def logprobs(dev, dt, s):
        return (torch.randn(s["t"], s["v"], device=dev, dtype=dt), torch.randint(0, s["v"], (s["t"],), device=dev)), {}

    return {
        "rms_norm": Case(rms, (0, 1)),
        "apply_rotary": Case(rotary, (0,)),
        "attention": Case(attn, (0, 1, 2)),
        "sparse_attention": Case(sparse, (0, 1, 2)),
        "lightning_indexer": Case(indexer),
        "kpool_indexer": Case(kpool_indexer),
        "swiglu": Case(swiglu, (0,)),
        "moe_route": Case(route, (0,)),
        "moe_permute": Case(permute, (0,)),
        "moe_unpermute": Case(unpermute, (0, 2)),
        "grouped_matmul": Case(gmm, (0, 1)),
        "token_log_probs": Case(logprobs, (0,)),
        "kda": Case(kda, (0, 1, 2, 3, 4)),
        "causal_conv1d": Case(causal_conv1d, (0, 1)),
        "kda_gate": Case(kda_gate, (0, 1, 2)),
        "fp8_block_quantize": Case(fp8_quantize),
    }


def _float_outputs(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _run(fn, args, kwargs, grad_args, backward: bool):
    args = [a.detach().requires_grad_(i in grad_args) if isinstance(a, torch.Tensor) and i in grad_args else a
            for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    if backward and grad_args:
        floats = [o for o in _float_outputs(out) if o.requires_grad]
        if floats:
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
    return out


def _time(acc, fn, args, kwargs, grad_args, backward, min_s: float, max_iters: int) -> float:
    _run(fn, args, kwargs, grad_args, backward)  # warm-up (kernel selection, caches)
    acc.synchronize()
    iters, start = 0, time.perf_counter()
    while iters < max_iters:
        _run(fn, args, kwargs, grad_args, backward)
        iters += 1
        acc.synchronize()
        if time.perf_counter() - start >= min_s:
            break
    return (time.perf_counter() - start) / iters * 1000.0


def _by_expert(out):
    """moe_route's slot order is implementation-defined: sort each row's pairs by expert id."""
    weights, indices = out
    order = indices.argsort(dim=-1)
    return weights.gather(1, order), indices.gather(1, order)


def _error(name: str, dev_out, ref_out) -> str:
    """Float outputs: max |dev - ref| / max(1, max |ref|). Index outputs: share of rows whose sets differ."""
    if name == "moe_route":
        dev_out, ref_out = _by_expert(dev_out), _by_expert(ref_out)
    d, r = _float_outputs(dev_out), _float_outputs(ref_out)
    if d and r:
        errs = [(a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item()) for a, b in zip(d, r)]
        return f"{max(errs):.2e}"
    a, b = (dev_out[0] if isinstance(dev_out, tuple) else dev_out), (ref_out[0] if isinstance(ref_out, tuple) else ref_out)
    differ = (a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item()
    return f"{differ:.1%} rows differ"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OP_NAMES), help="comma-separated op names")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on cpu, large otherwise")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--min-seconds", type=float, default=0.2, help="time budget per measurement")
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--npu-sim", action="store_true", help="run the Ascend implementations on the torch_npu simulator")
    a = p.parse_args(argv)
    unknown = [o for o in a.ops.split(",") if o not in OP_NAMES]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {', '.join(OP_NAMES)}")
    context = contextlib.nullcontext(None)
    if a.npu_sim:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        import npu_sim

        context = npu_sim.activate()
    with context as sim_acc:
        acc = sim_acc or get_accelerator()
        size = SIZES[a.size or ("small" if acc.device().type == "cpu" else "large")]
        dtype = getattr(torch, a.dtype)
        dev = acc.device()
        torch.manual_seed(0)
        print(f"accelerator: {acc.describe()}\nsize: {size}, dtype: {a.dtype}")
        print(f"{'op':<18} {'implementation':<52} {'ref ms':>9} {'dev ms':>9} {'speedup':>8}  error (rel. max / index rows)")
        cases = _cases()
        for name in a.ops.split(","):
            case = cases[name]
            args, kwargs = case.make(dev, dtype, size)
            dev_fn, ref_fn = getattr(acc.ops, name), reference_op(name)
            backward = bool(case.grad_args)
            with torch.no_grad():
                err = _error(name, dev_fn(*args, **kwargs), ref_fn(*args, **kwargs))
            t_ref = _time(acc, ref_fn, args, kwargs, case.grad_args, backward, a.min_seconds, a.max_iters)
            t_dev = _time(acc, dev_fn, args, kwargs, case.grad_args, backward, a.min_seconds, a.max_iters)
            label = acc.ops.source(name) + (" (fwd+bwd)" if backward else "")
            print(f"{name:<18} {label:<52} {t_ref:>9.2f} {t_dev:>9.2f} {t_ref / t_dev:>7.2f}x  {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
