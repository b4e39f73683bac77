"""Training-step throughput: slime's megatron GLM model vs transformers on the same tiny checkpoint.

    python benchmarks/train_step.py [--model-type glm_moe_dsa] [--seq 256] [--batch 2] [--steps 7] [--threads N]

Both run forward + backward of sum(logits * w) on the same tokens and weights (float32 by default) on
the current accelerator; prints tokens/s of each and the ratio megatron / transformers. The two sides
alternate step by step (after one warm-up step each) and the medians are compared, so a change of load
on a shared machine hits both alike. The process CPU time of each step is printed too: on a host loaded
past its cores wall time is mostly waiting, and with --threads 1 the CPU-time ratio is the work ratio.
transformers runs with slime's transformers patch set, as the embedded engine runs it (--plain-transformers:
without), so both sides keep the same DSA keys.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from statistics import median

import torch


def _timed(step, sync, cpu_times: list[float] | None = None) -> float:
    """Wall seconds of one step; its process CPU seconds are appended to cpu_times when given."""
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    sync()
    wall = time.perf_counter() - start
    if cpu_times is not None:
        cpu_times.append(time.process_time() - cpu)
    return wall


def interleaved(a, b, steps: int, sync, cpu_times: tuple[list[float], list[float]] | None = None
                ) -> tuple[list[float], list[float]]:
    """Seconds of each step of `a` and `b`, run alternately (a, b, a, b, ...) after one warm-up of each;
    cpu_times (two lists), when given, receive each step's process CPU seconds."""
    a()
    b()
    ca, cb = cpu_times or (None, None)
    ta, tb = [], []
    for _ in range(steps):
        ta.append(_timed(a, sync, ca))
        tb.append(_timed(b, sync, cb))
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-type", default="glm_moe_dsa", choices=["glm_moe_dsa", "glm4_moe_lite"])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). 1 on a loaded host: the CPU-time ratio then "
                         "counts work only, no threads waiting for each other")
    ap.add_argument("--plain-transformers", action="store_true",
                    help="transformers without slime's transformers patch set (default: with it, as the embedded "
                         "engine and the agreement tests run it: DSA top-k ties go to the lowest key position, the "
                         "rule of ops.lightning_indexer, so both sides select the same keys)")
    a = ap.parse_args()
    if a.threads is not None:
        if a.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM

    from slime.accelerator import get_accelerator
    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    acc = get_accelerator()
    if not a.plain_transformers:
        acc.apply_patches("transformers")
    dev, dtype = acc.device(), getattr(torch, a.dtype)
    heads = max(4, a.hidden // 64)
    sizes = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=heads,
                 intermediate_size=2 * a.hidden, moe_intermediate_size=a.hidden // 2, q_lora_rank=a.hidden // 2,
                 kv_lora_rank=a.hidden // 4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 max_position_embeddings=max(512, a.seq))
    if a.model_type == "glm_moe_dsa":
        sizes |= dict(index_topk=max(8, a.seq // 4), index_head_dim=32)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(f"{tmp}/ckpt", a.model_type, seed=0, **sizes)
        megatron = load_hf_model(ckpt, dtype=dtype).train()
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).train()
    vocab = megatron.arch.vocab_size
    ids = torch.randint(3, vocab, (a.batch, a.seq), device=dev)
    pos = torch.arange(a.seq, device=dev).expand(a.batch, a.seq)
    weight = torch.randn(a.batch, a.seq, vocab, device=dev, dtype=dtype)

    def megatron_step():
        megatron.zero_grad(set_to_none=True)
        (megatron(ids, pos) * weight).sum().backward()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        (hf(ids, position_ids=pos).logits * weight).sum().backward()

    tokens = a.batch * a.seq
    cpu = ([], [])
    meg_times, hf_times = interleaved(megatron_step, hf_step, a.steps, acc.synchronize, cpu)
    t_meg, t_hf = median(meg_times), median(hf_times)
    c_meg, c_hf = median(cpu[0]), median(cpu[1])
    print(f"device={acc.name} model={a.model_type} hidden={a.hidden} layers={a.layers} batch={a.batch} seq={a.seq} "
          f"dtype={a.dtype} threads={torch.get_num_threads()} transformers_patches={not a.plain_transformers} "
          f"ops={acc.ops!r}")
    print(f"megatron     fwd+bwd: {tokens / t_meg:10.1f} tokens/s ({t_meg * 1e3:.1f} ms/step)")
    print(f"transformers fwd+bwd: {tokens / t_hf:10.1f} tokens/s ({t_hf * 1e3:.1f} ms/step)")
    pairs = median(h / m for m, h in zip(meg_times, hf_times))
    print(f"ratio megatron/transformers: {t_hf / t_meg:.2f}x (median of per-pair ratios {pairs:.2f}x, {a.steps} "
          f"alternating steps; load average {os.getloadavg()[0]:.1f})")
    print(f"CPU time per step: megatron {c_meg * 1e3:.1f} ms, transformers {c_hf * 1e3:.1f} ms, ratio "
          f"transformers/megatron {c_hf / c_meg:.2f}x (process CPU time: counts all threads, spin-waits included)")


if __name__ == "__main__":
    main()
