"""mHC hyper-connection forward + backward: the glm5_next family's HyperConnection vs transformers' module.

    python benchmarks/mhc.py [--tokens 4096] [--hidden 1024] [--hc 4] [--repeats 5] [--threads N]

Both modules get the same weights (fn, base, scale) and the same streams [1, tokens, hc, hidden] (float32); one
step is forward (post, comb, block input) + backward of sum(outputs * w) to the weights and the streams. The sides
alternate step by step after one warm-up each (benchmarks/train_step.py's `interleaved`); printed: the median wall
and process CPU time of each, their ratios transformers / ours, the load average, the peak memory of one step of
each (RSS high-water mark above the inputs, in a fresh process per side with mmap-ed large allocations) and the
largest relative difference of outputs and grads.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from statistics import median

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

from train_step import interleaved  # noqa: E402

SIDES = ("ours", "transformers")


def build(hidden: int, hc: int):
    """(ours, transformers') with the same non-trivial weights, and the config's arch."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    from slime_plugins.models.glm5_next.config import from_hf
    from slime_plugins.models.glm5_next.hyper import HyperConnection
    from slime_plugins.models.glm5_next.tiny import tiny_config

    config = tiny_config("glm5_next_text", hidden_size=hidden, hc_mult=hc)
    ours, theirs = HyperConnection(from_hf(config.to_dict()), torch.float32, False), Glm5NextTextHyperConnection(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            value = torch.randn(getattr(ours, name).shape, generator=g) * (0.05 if name == "fn" else 0.5)
            getattr(ours, name).copy_(value)
            getattr(theirs, name).copy_(value)
    return ours, theirs


def make_step(module, tokens: int, hidden: int, hc: int):
    """step() -> (outputs, grads of fn, base, scale and the streams) on seeded inputs, the same for both sides."""
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(1, tokens, hc, hidden, generator=g).requires_grad_(True)
    weights = [torch.randn(1, tokens, hc, generator=g), torch.randn(1, tokens, hc, hc, generator=g),
               torch.randn(1, tokens, hidden, generator=g)]
    params = [module.fn, module.base, module.scale, streams]

    def step():
        outs = module(streams)
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), params)
        return [o.detach() for o in outs], grads

    return step


def peak_memory(side: str, a) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    cmd = [sys.executable, __file__, "--peak-of", side, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
           "--hc", str(a.hc), "--threads", str(torch.get_num_threads())]
    return int(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def _peak_in_process(side: str, a) -> int:
    """One step's RSS high-water mark above its inputs, after a warm-up step on 8 tokens."""
    module = build(a.hidden, a.hc)[SIDES.index(side)]
    make_step(module, 8, a.hidden, a.hc)()
    step = make_step(module, a.tokens, a.hidden, a.hc)
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def saved_bytes(module, tokens: int, hidden: int, hc: int) -> int:
    """Bytes autograd keeps from forward to backward (distinct storages; the input streams not counted): what a
    whole model holds per hyper-connection until its backward."""
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(1, tokens, hc, hidden, generator=g).requires_grad_(True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(streams)
    storages.pop(streams.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run(a) -> dict:
    steps = [make_step(m, a.tokens, a.hidden, a.hc) for m in build(a.hidden, a.hc)]
    (outs_ours, grads_ours), (outs_hf, grads_hf) = steps[0](), steps[1]()
    rel = dict(outputs=max(_rel(x, y) for x, y in zip(outs_ours, outs_hf)),
               grads=max(_rel(x, y) for x, y in zip(grads_ours, grads_hf)))
    cpu = ([], [])
    load_before = os.getloadavg()[0]
    t_ours, t_hf = interleaved(steps[0], steps[1], a.repeats, lambda: None, cpu)
    load_after = os.getloadavg()[0]
    peaks = {} if a.no_memory else {side: peak_memory(side, a) for side in SIDES}
    held = [saved_bytes(m, a.tokens, a.hidden, a.hc) for m in build(a.hidden, a.hc)]
    r = dict(wall=(median(t_ours), median(t_hf)), cpu=(median(cpu[0]), median(cpu[1])), rel=rel, peaks=peaks,
             held=held)
    print(f"mHC tokens={a.tokens} hc={a.hc} hidden={a.hidden} float32 threads={torch.get_num_threads()}")
    for side, wall, c, kept in zip(SIDES, r["wall"], r["cpu"], held):
        mem = f", peak {peaks[side] / 2**20:.0f} MiB" if peaks else ""
        print(f"{side:<12} fwd+bwd: {wall * 1e3:8.1f} ms wall, {c * 1e3:8.1f} ms CPU{mem}, "
              f"kept for backward {kept / 2**20:.2f} MiB")
    print(f"ratio transformers/ours: wall {r['wall'][1] / r['wall'][0]:.2f}x, CPU {r['cpu'][1] / r['cpu'][0]:.2f}x "
          f"({a.repeats} alternating steps, medians; load average {load_before:.1f} -> {load_after:.1f})")
    print(f"max relative difference: outputs {rel['outputs']:.2e}, grads {rel['grads']:.2e}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--hc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-memory", action="store_true", help="skip the two peak-memory processes")
    ap.add_argument("--peak-of", choices=SIDES, help=argparse.SUPPRESS)  # the memory child
    a = ap.parse_args(argv)
    for name in ("tokens", "hidden", "hc", "repeats"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.peak_of:
        print(_peak_in_process(a.peak_of, a))
        return 0
    run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
