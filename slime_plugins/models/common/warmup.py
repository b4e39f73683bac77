"""A short supervised warm-up of a tiny random-init model on the synthetic string tasks, the prior that
RL post-training of a real model starts from (pretraining and SFT). Next-token cross entropy on the
answer and its EOS, prompts rendered with the tiny tokenizer's chat template exactly as the rollout
renders them (`--apply-chat-template`), Adam, CPU, seeded.

    python -m slime_plugins.models.glm5.tiny OUT_DIR --warmup-steps 150 [--warmup-tasks copy]

A task spec is `task[:min-max][@noise]` (lengths of the string, default 3-5; the probability that an answer
symbol is replaced by a random letter, default 0), e.g. `reverse`, `copy:1-2` or `copy@0.5`; the batches
cycle through the specs. The `answer` task's examples take either of its two forms: the copy after the word
`answer` (the one its reward pays; ANSWER_FORM_SHARE of them) or the bare copy, the quick start's prior. A short warm-up leaves the model partly competent: at temperature 1 it copies
some symbols and stops at about the right length, so GRPO's groups have variance in the prompt-conditional
part of the reward from the first rollout (docs/training.md, "What the quick start learns", has the
measurements of each warm-up tried).
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

DEFAULT_TASKS = "copy"
PROGRESS_EVERY_S = 5.0  # warm-up progress lines to stderr: no silent minute while the quick start writes its model
# The share of the answer task's warm-up examples in the paid form: the prior answers in that form about this
# often (its last batches move it: 0.21 after 250 steps, 0.40 after 300 on the tiny GLM-5.3-Flash), so its reward
# at RL's start is about that times its copy accuracy. The tiny GLM-5 at one half: GRPO's first steps lifted the
# mean of the first 5 rollouts to 0.53-0.61 in three seeds; at 0.4 the tiny GLM-5.3-Flash's prior (300 steps)
# was paid 0.46 and its first 5 rollouts 0.61. 0.3 starts it lower, so that the curve shows what RL added.
ANSWER_FORM_SHARE = 0.3
# Extra forward arguments by model_type. transformers' torch KDA (GLM-5.3-Flash's linear attention; the fla kernel
# is not installed on CPU) pads every sequence to a chunk of 64 tokens and runs a 63-step loop inside it; the
# warm-up's sequences are at most 16 tokens, so 16-token chunks give the same values (the chunked delta rule is
# exact for any chunk size) at a third of the CPU time (0.52 -> 0.17 s a step, batch 32, one thread).
FORWARD_KWARGS: dict[str, dict[str, Any]] = {"glm5_next": {"chunk_size": 16}}


def forward_kwargs(model: Any) -> dict[str, Any]:
    """The extra forward arguments of `model`'s type (FORWARD_KWARGS); {} for the others."""
    return FORWARD_KWARGS.get(model.config.model_type, {})


def parse_tasks(spec: str) -> list[tuple[str, int, int, float]]:
    """`"reverse,copy:1-2@0.5"` -> [("reverse", 3, 5, 0.0), ("copy", 1, 2, 0.5)]: task, string lengths and the
    probability that each answer symbol is replaced by a random letter (noisy labels)."""
    from slime.rollout.synthetic import TASKS

    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        part, _, noise_s = part.partition("@")
        try:
            noise = float(noise_s) if noise_s else 0.0
        except ValueError:
            noise = -1.0
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"bad warm-up task {part}@{noise_s}: the label noise after @ is a probability in [0, 1]")
        task, _, lens = part.partition(":")
        lo, hi = 3, 5
        if lens:
            try:
                lo, hi = (int(x) for x in lens.split("-")) if "-" in lens else (int(lens), int(lens))
            except ValueError:
                raise ValueError(f"bad warm-up task {part!r}: lengths are min-max, e.g. copy:1-2") from None
        if task not in TASKS or not 1 <= lo <= hi:
            raise ValueError(f"bad warm-up task {part!r}: want task[:min-max] with task in {TASKS}, 1 <= min <= max")
        out.append((task, lo, hi, noise))
    if not out:
        raise ValueError("no warm-up task given")
    return out


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids the rollout feeds the model for `prompt` (chat template, generation prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)


def _batch(tokenizer: Any, rng: random.Random, task: tuple[str, int, int, float], batch_size: int):
    """One batch of one task and one string length: ids [B, T] and a mask of answer tokens."""
    import torch

    from slime.rollout.synthetic import ALPHABET, FORMAT_TASK, FORMAT_WORD, make_example

    name, lo, hi, noise = task
    n = rng.randint(lo, hi)
    rows = [make_example(rng, name, n, n) for _ in range(batch_size)]
    seqs, masks = [], []
    for r in rows:
        p = prompt_ids(tokenizer, r["prompt"])
        label = " ".join(rng.choice(ALPHABET) if noise and rng.random() < noise else s for s in r["label"].split())
        if name == FORMAT_TASK and rng.random() < ANSWER_FORM_SHARE:  # the task's two forms: the prior's choice
            label = f"{FORMAT_WORD} {label}"
        a = tokenizer(label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, seqs))  # the answer task's two forms differ in length: right-pad, outside the mask
    seqs = [q + [tokenizer.pad_token_id] * (width - len(q)) for q in seqs]
    masks = [m + [0] * (width - len(m)) for m in masks]
    return torch.tensor(seqs), torch.tensor(masks, dtype=torch.bool)


def warmup(model: Any, tokenizer: Any, steps: int, seed: int = 0, tasks: str = DEFAULT_TASKS, lr: float = 1e-3,
           batch_size: int = 32) -> list[float]:
    """Train `model` in place for `steps` Adam steps; returns the loss of each step."""
    import torch

    specs = parse_tasks(tasks)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    model.train()
    losses = []
    # One thread: the tensors are tiny, so threads only add contention (on a loaded 2-core host a step took
    # 2-4 s with two threads and 0.06 s with one), and a fixed thread count keeps the result reproducible.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    extra = forward_kwargs(model)
    start = last_line = time.perf_counter()
    try:
        for step in range(steps):
            if losses and time.perf_counter() - last_line >= PROGRESS_EVERY_S:  # a line every few seconds
                last_line = time.perf_counter()
                print(f"  warm-up step {step}/{steps}, loss {losses[-1]:.3f} ({last_line - start:.0f} s)",
                      file=sys.stderr, flush=True)
            ids, mask = _batch(tokenizer, rng, specs[step % len(specs)], batch_size)
            logits = model(input_ids=ids, **extra).logits[:, :-1].float()
            target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    if steps:
        print(f"  warm-up: {steps} steps in {time.perf_counter() - start:.0f} s, last loss {losses[-1]:.3f}",
              file=sys.stderr, flush=True)
    model.eval()
    return losses


def mean_reward(model: Any, tokenizer: Any, rows: list[dict[str, Any]], temperature: float = 1.0, seed: int = 0,
                max_new_tokens: int = 8) -> float:
    """Mean `--rm-type synthetic` reward of `model`'s answers to `rows` (synthetic.make_dataset rows), sampled
    at `temperature` (0: greedy) over the whole vocabulary, as the quick start's rollouts are."""
    import torch

    from slime.rollout.synthetic import task_reward

    gen = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[tuple[list[int], str, str | None]]] = {}
    for r in rows:
        p = prompt_ids(tokenizer, r["prompt"])
        by_len.setdefault(len(p), []).append((p, r["label"], r.get("metadata", {}).get("task")))
    total = 0.0
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        for group in by_len.values():
            ids = torch.tensor([p for p, _, _ in group])
            out = torch.empty(len(group), 0, dtype=torch.long)
            done = torch.zeros(len(group), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.cat([ids, out], 1), **forward_kwargs(model)).logits[:, -1].float()
                if temperature > 0:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
                else:
                    nxt = logits.argmax(-1)
                nxt = nxt.masked_fill(done, tokenizer.pad_token_id)
                done |= nxt == tokenizer.eos_token_id
                out = torch.cat([out, nxt[:, None]], 1)
                if bool(done.all()):
                    break
            for (_, label, task), row, stopped in zip(group, out.tolist(), done.tolist()):
                total += task_reward(tokenizer.decode(row, skip_special_tokens=True), label, task, stopped)
    torch.set_num_threads(threads)
    return total / len(rows)
