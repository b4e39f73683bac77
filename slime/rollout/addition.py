"""A verifiable task for a small pretrained chat model: add two numbers, answer first.

    python -m slime.rollout.addition --out data.jsonl     # {"prompt": "What is 3 + 5? Reply with the number only.", "label": "8"}
    train.py ... --apply-chat-template --custom-rm-path slime.rollout.addition.reward

The reward is 1 when the FIRST number of the response is the sum, else 0. Why these choices (measured with
SmolLM2-135M-Instruct, docs/training.md): on two-digit sums it is right 0 times in 64 samples, whatever the
format (a \\boxed{} answer, `--rm-type math`, is never produced either), so a 0/1 reward gives GRPO no
variance to learn from. On one-digit operands it knows many sums but mostly restates the question first
("3 + 5 = 8"), which this reward scores 0: what RL can teach it in a few rollouts is to answer directly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def make_dataset(n: int, seed: int = 0, max_operand: int = 9) -> list[dict[str, Any]]:
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"What is {a} + {b}? Reply with the number only.", "label": str(a + b)})
    return rows


def score(response: str, label: str) -> float:
    found = _NUMBER.search(response.replace(",", ""))
    return float(found is not None and found.group() == str(label).strip())


async def reward(args, sample, **kwargs) -> float:
    """--custom-rm-path: upstream's single-sample reward signature."""
    return score(sample.response, sample.label)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m slime.rollout.addition", description="Write the addition task JSONL.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=9)
    a = ap.parse_args(argv)
    tmp = f"{a.out}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in make_dataset(a.num, a.seed, a.max_operand):
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, a.out)


if __name__ == "__main__":  # pragma: no cover
    main()
