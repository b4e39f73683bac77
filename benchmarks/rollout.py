"""Embedded engine throughput vs plain transformers `generate`: same model, same prompts, same run.

    python benchmarks/rollout.py                       # tiny GLM-5 checkpoint, written to a temp dir
    python benchmarks/rollout.py --model-path DIR --num-prompts 128 --max-new-tokens 64

Both sides produce exactly --max-new-tokens tokens per prompt (EOS ignored), greedy. The engine is
driven over HTTP by concurrent clients, as the rollout manager drives it; transformers gets the
whole prompt set as one left-padded batch (its best case). Prints tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="HF checkpoint (default: a tiny random GLM-5)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=8)
    ap.add_argument("--max-prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per side (after one warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for length in lengths]


def bench_engine(url: str, token: str, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    from slime.utils.http_client import EngineClient

    client = EngineClient(url, token)
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    counts = [0] * len(prompts)

    def one(i: int) -> None:
        counts[i] = len(client.generate(prompts[i], params, return_logprob=True)["output_ids"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(counts)


@torch.inference_mode()
def bench_transformers(model, prompts: list[list[int]], max_new: int, pad_id: int) -> tuple[float, int]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0, int((out.shape[1] - width) * len(prompts))


def main() -> None:
    a = parse_args()
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer

    path = a.model_path
    if path is None:
        from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(tempfile.mkdtemp(prefix="bench-") + "/tiny", "glm_moe_dsa")
    engine = EmbeddedEngine(EngineConfig(model_path=path, max_running_requests=max(64, a.num_prompts)))
    server = EngineHTTPServer(engine, "bench", 0)
    server.start_in_thread()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.model.dtype).to(engine.device).eval()
    prompts = make_prompts(a.num_prompts, a.min_prompt_len, a.max_prompt_len, engine.vocab_size, a.seed)
    pad = int(getattr(model.config, "pad_token_id", None) or 0)
    try:
        bench_engine(server.url, "bench", prompts, a.max_new_tokens)  # warm-up
        bench_transformers(model, prompts, a.max_new_tokens, pad)
        eng_t = eng_n = hf_t = hf_n = 0.0
        for _ in range(a.repeats):
            t, n = bench_engine(server.url, "bench", prompts, a.max_new_tokens)
            eng_t, eng_n = eng_t + t, eng_n + n
            t, n = bench_transformers(model, prompts, a.max_new_tokens, pad)
            hf_t, hf_n = hf_t + t, hf_n + n
    finally:
        server.stop()
    eng, hf = eng_n / eng_t, hf_n / hf_t
    print(f"model {path} on {engine.device}: {a.num_prompts} prompts x {a.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"embedded engine (HTTP, concurrent clients): {eng:10.1f} tokens/s")
    print(f"transformers generate (one padded batch):   {hf:10.1f} tokens/s")
    print(f"ratio engine / transformers: {eng / hf:.2f}")
    print(f"engine waves: {engine.stats['waves']} for {a.repeats + 1} rounds of {a.num_prompts} requests")


if __name__ == "__main__":
    main()
