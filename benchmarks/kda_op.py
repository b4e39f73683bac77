"""ops.kda (forward + backward) against transformers' torch chunk_kimi_delta_attention, same inputs, same run.

    python benchmarks/kda_op.py                                   # 512 and 4096 tokens, H 4..8, D 64..128
    python benchmarks/kda_op.py --shapes 4096x8x128 --repeats 3

Per shape (tokens x heads x head dim, one sequence, float32, GLM-5.3-Flash's gate: log-decay in [-5, 0]):
the wall time and the process CPU time of one forward + backward of each (the mean of --repeats, after one
warm-up call of each on a tiny input), their ratio transformers / ours, the peak memory of one forward + backward
above what its inputs hold (the accelerator's peak-memory counter; on CPU the RSS high-water mark of a fresh
process per measurement, see peak_memory), and the largest |difference| of the outputs. CPU time is printed beside wall time because a shared
machine's wall time depends on its load; on an idle machine with one thread the two agree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from slime.accelerator import get_accelerator  # noqa: E402

DEFAULT_SHAPES = "512x4x64,512x8x128,4096x4x128,4096x8x128"


def make_inputs(tokens: int, heads: int, dim: int, device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, dim, generator=g) for _ in range(3))
    decay = -5.0 * torch.sigmoid(torch.randn(tokens, heads, dim, generator=g))
    beta = torch.rand(tokens, heads, generator=g)
    return [t.to(device) for t in (q, k, v, decay, beta)]


def ours(inputs, cu_seqlens):
    return get_accelerator().ops.kda(*inputs, cu_seqlens)


def transformers_chunk(inputs, cu_seqlens):
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

    out, _ = chunk_kimi_delta_attention(*(t[None] for t in inputs), use_qk_l2norm_in_kernel=True)
    return out[0]


def step(fn, inputs, cu_seqlens) -> torch.Tensor:
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(leaves, cu_seqlens)
    out.backward(torch.ones_like(out))
    return out.detach()


def measure(fn, inputs, cu_seqlens, repeats: int) -> dict:
    """Mean wall and CPU seconds of `repeats` forward+backward runs, and the last output."""
    acc = get_accelerator()
    acc.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        out = step(fn, inputs, cu_seqlens)
    acc.synchronize()
    return dict(out=out, wall=(time.perf_counter() - wall) / repeats, cpu=(time.process_time() - cpu) / repeats)


def peak_memory(name: str, shape: str) -> int:
    """Peak bytes of one forward+backward of `name` above what the inputs hold. On CPU in a fresh process whose
    large allocations are mmap-ed (MALLOC_MMAP_THRESHOLD_): freed memory leaves the RSS at once, so the RSS
    high-water mark follows the live tensors instead of the heap that earlier runs left behind."""
    if get_accelerator().device().type != "cpu":
        return _peak_in_process(name, shape)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    out = subprocess.run([sys.executable, __file__, "--peak-of", name, "--shapes", shape], env=env, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def _peak_in_process(name: str, shape: str) -> int:
    acc = get_accelerator()
    tokens, heads, dim = parse_shapes(shape)[0]
    inputs = make_inputs(tokens, heads, dim, acc.device())
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=acc.device())
    fn = IMPLEMENTATIONS[name]
    step(fn, make_inputs(64, 2, 16, acc.device()), torch.tensor([0, 64], dtype=torch.int32, device=acc.device()))
    acc.synchronize()
    acc.reset_peak_memory_stats()
    base = acc.memory_stats()["allocated"]
    step(fn, inputs, cu)
    acc.synchronize()
    return acc.memory_stats()["peak_allocated"] - base


IMPLEMENTATIONS = {"ours": ours, "transformers": transformers_chunk}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: use TOKENSxHEADSxDIM,... (e.g. {DEFAULT_SHAPES})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated TOKENSxHEADSxDIM")
    p.add_argument("--repeats", type=int, default=2, help="timed forward+backward runs per side and shape")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--peak-of", choices=sorted(IMPLEMENTATIONS), help=argparse.SUPPRESS)  # the memory child
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.peak_of:
        print(_peak_in_process(a.peak_of, a.shapes))
        return 0
    acc = get_accelerator()
    print(f"accelerator: {acc.describe()}; ops.kda: {acc.ops.source('kda')}; threads {torch.get_num_threads()}")
    print(f"{'T x H x D':<14} {'ours s':>8} {'hf s':>8} {'wall x':>7} {'ours cpu':>9} {'hf cpu':>8} {'cpu x':>6} "
          f"{'ours MiB':>9} {'hf MiB':>8} {'max |diff|':>10}")
    warm = make_inputs(64, 2, 16, acc.device())
    for fn in (ours, transformers_chunk):  # first-call costs (lazy imports, allocator) outside the figures
        step(fn, warm, torch.tensor([0, 64], dtype=torch.int32, device=acc.device()))
    for tokens, heads, dim in parse_shapes(a.shapes):
        inputs = make_inputs(tokens, heads, dim, acc.device())
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=acc.device())
        mine, theirs = (measure(fn, inputs, cu, a.repeats) for fn in (ours, transformers_chunk))
        shape = f"{tokens}x{heads}x{dim}"
        mine["peak"], theirs["peak"] = (peak_memory(name, shape) for name in ("ours", "transformers"))
        diff = (mine["out"] - theirs["out"]).abs().max().item()
        print(f"{f'{tokens}x{heads}x{dim}':<14} {mine['wall']:>8.3f} {theirs['wall']:>8.3f} "
              f"{theirs['wall'] / mine['wall']:>6.1f}x {mine['cpu']:>9.3f} {theirs['cpu']:>8.3f} "
              f"{theirs['cpu'] / mine['cpu']:>5.1f}x {mine['peak'] / 2**20:>9.0f} {theirs['peak'] / 2**20:>8.0f} "
              f"{diff:>10.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
