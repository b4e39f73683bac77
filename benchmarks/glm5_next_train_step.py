"""Training step of GLM-5.3-Flash (glm5_next): slime's megatron model vs transformers on the same checkpoint.

    python benchmarks/glm5_next_train_step.py [--seq 512] [--batch 1] [--steps 3] [--threads N]

A `Glm5NextForConditionalGeneration` is written by transformers (seeded; hidden 256, 6 layers: KDA, KDA, DSA
full, DSA shared, KDA, DSA full; a dense first MLP, then 8 routed + 1 shared experts; 4 mHC streams) and loaded
by both sides: the trainer's model through load_hf_model (the family's KDA, DSA and mHC) and transformers'
from_pretrained (eager attention, torch `chunk_kimi_delta_attention`, with slime's transformers patch set so both
DSA sides keep the same keys). Each step is forward + backward of sum(logits * w); the sides alternate step by
step after one warm-up each (benchmarks/train_step.py's `interleaved`) and the medians are compared. Printed: wall
and process CPU time per step and their ratios transformers / megatron (on a host loaded past its cores the CPU
time is the reliable figure), the load average, the peak memory of one step of each (RSS high-water mark above the
loaded model, in a fresh process per side with mmap-ed large allocations), and the logits' relative difference.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from statistics import median

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

from train_step import interleaved  # noqa: E402

SIDES = ("megatron", "transformers")


def text_config(hidden: int, layers: int, seq: int) -> dict:
    """The benchmark's text config: the tiny test model's features at a size where compute dominates."""
    from slime_plugins.models.glm5_next.tiny import TINY_TEXT

    mixers = ["linear_attention", "linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
              "indexed_attention"]
    indexers = ["full", "full", "full", "shared", "full", "full"]
    layer_types = [mixers[i % 6] for i in range(layers)]
    indexer_types = [indexers[i % 6] for i in range(layers)]
    return TINY_TEXT | dict(
        vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), indexer_types=indexer_types,
        linear_num_heads=4, linear_head_dim=64, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
        qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=max(8, seq // 8),
        swiglu_limit=10.0, max_position_embeddings=max(512, seq), initializer_range=0.02)


def write_checkpoint(path: str, hidden: int, layers: int, seq: int) -> str:
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    from slime_plugins.models.glm5_next.tiny import TINY_VISION

    torch.manual_seed(0)
    config = AutoConfig.for_model("glm5_next", text_config=text_config(hidden, layers, seq),
                                  vision_config=dict(TINY_VISION, out_hidden_size=hidden), tie_word_embeddings=False)
    Glm5NextForConditionalGeneration(config).float().save_pretrained(path)
    return path


def load(side: str, ckpt: str):
    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    acc.apply_patches("transformers")
    if side == "megatron":
        from slime.backends.megatron import load_hf_model

        return load_hf_model(ckpt, dtype=torch.float32).train()
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                            attn_implementation="eager").to(acc.device()).train()


def make_step(side: str, model, batch: int, seq: int):
    """(step() -> logits, the batch's weight) on seeded tokens, the same for both sides."""
    from slime.accelerator import get_accelerator

    dev = get_accelerator().device()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.text_config.vocab_size if side == "transformers" else model.arch.vocab_size
    ids = torch.randint(3, vocab, (batch, seq), generator=g).to(dev)
    pos = torch.arange(seq, device=dev).expand(batch, seq)
    weight = torch.randn(batch, seq, vocab, generator=g).to(dev)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos) if side == "megatron" else model(input_ids=ids, position_ids=pos).logits
        (logits * weight).sum().backward()
        return logits.detach()

    return step


def peak_memory(side: str, ckpt: str, batch: int, seq: int) -> int:
    """Bytes of one step's RSS high-water mark above the loaded model and inputs, in a fresh process (after a
    warm-up step on 8 tokens, so first-call allocations are not counted)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    cmd = [sys.executable, __file__, "--peak-of", side, "--ckpt", ckpt, "--batch", str(batch), "--seq", str(seq),
           "--threads", str(torch.get_num_threads())]
    return int(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def _peak_in_process(side: str, ckpt: str, batch: int, seq: int) -> int:
    model = load(side, ckpt)
    make_step(side, model, 1, min(8, seq))()
    step = make_step(side, model, batch, seq)
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def run(a) -> dict:
    """Time both sides on one checkpoint; returns the figures (also printed)."""
    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(f"{tmp}/ckpt", a.hidden, a.layers, a.seq)
        steps = {side: make_step(side, load(side, ckpt), a.batch, a.seq) for side in SIDES}
        logits = {side: steps[side]() for side in SIDES}
        rel = float((logits["megatron"] - logits["transformers"]).abs().max() / logits["transformers"].abs().max())
        cpu = ([], [])
        load_before = os.getloadavg()[0]
        t_meg, t_hf = interleaved(steps["megatron"], steps["transformers"], a.steps, acc.synchronize, cpu)
        load_after = os.getloadavg()[0]
        peaks = {side: peak_memory(side, ckpt, a.batch, a.seq) for side in SIDES} if not a.no_memory else {}
    r = dict(wall=(median(t_meg), median(t_hf)), cpu=(median(cpu[0]), median(cpu[1])), rel=rel, peaks=peaks,
             load=(load_before, load_after))
    tokens = a.batch * a.seq
    print(f"device={acc.name} glm5_next hidden={a.hidden} layers={a.layers} batch={a.batch} seq={a.seq} float32 "
          f"threads={torch.get_num_threads()} ops={acc.ops!r}")
    for side, wall, c in zip(SIDES, r["wall"], r["cpu"]):
        mem = f", peak {peaks[side] / 2**20:.0f} MiB" if peaks else ""
        print(f"{side:<12} fwd+bwd: {tokens / wall:9.1f} tokens/s ({wall * 1e3:.0f} ms/step wall, "
              f"{c * 1e3:.0f} ms CPU{mem})")
    print(f"ratio transformers/megatron: wall {r['wall'][1] / r['wall'][0]:.2f}x, CPU {r['cpu'][1] / r['cpu'][0]:.2f}x "
          f"({a.steps} alternating steps, medians; load average {load_before:.1f} -> {load_after:.1f})")
    print(f"logits max |megatron - transformers| / max |transformers| = {rel:.2e}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-memory", action="store_true", help="skip the two peak-memory processes")
    ap.add_argument("--peak-of", choices=SIDES, help=argparse.SUPPRESS)  # the memory child
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("seq", "batch", "steps", "hidden", "layers"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.hidden % 4:
        raise SystemExit(f"--hidden must be a multiple of 4 (4 heads), got {a.hidden}")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.peak_of:
        print(_peak_in_process(a.peak_of, a.ckpt, a.batch, a.seq))
        return 0
    run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
