"""A verifiable task for RL on a tiny random-init model: copy (or reverse) a short string over a
5-letter alphabet; the "answer" task is the copy paid only in the answer format (`task_reward`), the quick
start's task.

    python -m slime.rollout.synthetic --out data.jsonl            # {"prompt": "copy : c a d =", "label": "c a d"}
    train.py ... --prompt-data data.jsonl --apply-chat-template --rm-type synthetic --rollout-max-response-len 8

Why the reward is shaped: the tiny model (vocab 512) starts with almost uniform next-token
probabilities, so a given letter appears with probability ~1/512 and an exact copy of 3-5
letters essentially never. A 0/1 reward would be zero for every sample of every GRPO group, and
zero within-group variance means zero advantage: nothing to learn from. The reward therefore gives
credit at three levels, each reachable from the previous one:

  1. alphabet (weight 0.2): fraction of the first L response symbols that are alphabet letters.
     At init ~1% of tokens are (5/512), so among n_samples x L tokens of a group some hit: the
     groups get variance and the policy learns to emit letters at all (a unigram shift of the
     output layer, the fastest thing to learn).
  2. position (weight 0.7): fraction of positions i < L where the symbol equals the target's.
     Once letters dominate, chance alone gives ~1/5 per position, so this term varies within
     every group and drives learning to attend to the prompt (copy) or to its end (reverse).
  3. stop (weight 0.1): 1 when the response is exactly L symbols (EOS right after them).

The maximum, 1.0, is an exact answer followed by EOS; a random model scores ~0.002. Keep
responses short (--rollout-max-response-len 8): more tokens add noise, not signal.

From a random-init checkpoint the quick start (60 rollouts of 8 prompts x 8 samples) learns level 1 and
none of level 2: the mean reward plateaus at ~0.35, the score of a prompt-independent answer of one
repeated letter (0.2 + 0.7 / 5 = 0.34). The first letter the policy finds takes the probability mass
before the prompt-conditional path carries any signal. The quick start's checkpoint is therefore warmed
up (slime_plugins/models/common/warmup.py) so that RL starts from a prior; docs/training.md ("What the
quick start learns") has the measurements of both.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

ALPHABET = ("a", "b", "c", "d", "e")
TASKS = ("copy", "reverse", "answer")
W_ALPHABET, W_POSITION, W_STOP = 0.2, 0.7, 0.1
# The "answer" task ("answer : c a d =" -> "answer c a d"): a copy that the reward pays only in the answer format,
# the word `answer` first. The quick start's warm-up teaches both forms for these prompts (the paid one in 40%
# of its examples, warmup.py), so the prior answers in the paid format less than half the time and GRPO has to
# select it.
FORMAT_TASK = "answer"
FORMAT_WORD = "answer"


def make_example(rng: random.Random, task: str, min_len: int = 3, max_len: int = 5) -> dict[str, Any]:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {TASKS}")
    symbols = [rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len))]
    target = symbols[::-1] if task == "reverse" else symbols  # "answer": a copy, in the answer format
    return {"prompt": f"{task} : {' '.join(symbols)} =", "label": " ".join(target), "metadata": {"task": task}}


def make_dataset(n: int, seed: int = 0, tasks: tuple[str, ...] = ("copy",), min_len: int = 3,
                 max_len: int = 5) -> list[dict[str, Any]]:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    return [make_example(rng, tasks[i % len(tasks)], min_len, max_len) for i in range(n)]


def score(response: str, label: str) -> float:
    """Shaped reward in [0, 1] of a decoded response against the label (see module doc)."""
    target = str(label).split()
    if not target:
        return 0.0
    got = response.split()
    n = len(target)
    head = got[:n] + [None] * (n - len(got[:n]))
    alphabet = sum(s in ALPHABET for s in head) / n
    position = sum(a == b for a, b in zip(head, target)) / n
    stop = 1.0 if len(got) == n else 0.0
    return W_ALPHABET * alphabet + W_POSITION * position + W_STOP * stop


def task_reward(response: str, label: str, task: str | None, stopped: bool) -> float:
    """The reward of a response (its EOS already removed) to a prompt of `task`: the shaped score, less the stop
    credit for an answer of the right length that did not stop (hit the length limit); for the "answer" task
    0 unless the response starts with the answer word, then the shaped score of what follows it."""
    if task == FORMAT_TASK:
        words = response.split()
        if not words or words[0] != FORMAT_WORD:
            return 0.0
        response = " ".join(words[1:])
    r = score(response, label)
    if not stopped and len(response.split()) == len(str(label).split()):
        r -= W_STOP
    return r


EOS_TEXT = "<eos>"  # the tiny tokenizer's EOS (slime.utils.tiny_tokenizer)


def synthetic_reward(args: Any, sample: Any) -> float:
    """`--rm-type synthetic`. A response that hit the length limit did not stop, so it gets no stop credit.
    The response text keeps special tokens unless --rollout-skip-special-tokens, so a response that stopped
    ends with the EOS token's text: it is the stop, not a symbol, and is dropped before scoring (counted as
    a symbol, it made an answer that stopped right one symbol too long: no stop credit was ever earned)."""
    from slime.rollout.sample import SampleStatus

    response = sample.response
    if sample.status == SampleStatus.COMPLETED:
        words = response.split()
        if words and words[-1] == EOS_TEXT:
            response = " ".join(words[:-1])
    task = (sample.metadata or {}).get("task")
    return task_reward(response, sample.label, task, sample.status != SampleStatus.TRUNCATED)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m slime.rollout.synthetic", description="Write the synthetic task JSONL.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="copy", help="comma-separated: copy,reverse,answer")
    ap.add_argument("--min-len", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=5)
    ap.add_argument("--exclude", default=None,
                    help="a JSONL of this task (e.g. the held-out eval set) whose prompts are left out of this one")
    a = ap.parse_args(argv)
    rows = make_dataset(a.num, a.seed, tuple(t.strip() for t in a.tasks.split(",") if t.strip()), a.min_len, a.max_len)
    if a.exclude:
        with open(a.exclude, encoding="utf-8") as f:
            held_out = {json.loads(line)["prompt"] for line in f if line.strip()}
        rows = [r for r in rows if r["prompt"] not in held_out]
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} examples to {a.out}")


if __name__ == "__main__":
    main()
