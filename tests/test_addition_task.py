"""The addition task of the SmolLM2 quick start (slime/rollout/addition.py): data and reward."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from slime.rollout.addition import main, make_dataset, reward, score
from slime.utils.types import Sample


def test_dataset_sums_are_the_labels_and_deterministic():
    rows = make_dataset(200, seed=5, max_operand=9)
    assert rows == make_dataset(200, seed=5, max_operand=9) and rows != make_dataset(200, seed=6)
    for row in rows:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
        assert 0 <= a <= 9 and 0 <= b <= 9 and row["label"] == str(a + b)
    with pytest.raises(ValueError, match="max_operand"):
        make_dataset(1, max_operand=0)


@pytest.mark.parametrize("response,label,expected", [
    ("8", "8", 1.0), (" 8.", "8", 1.0), ("The answer is 8", "8", 1.0), ("1,234", "1234", 1.0),
    ("3 + 5 = 8", "8", 0.0),  # restating the question first is what the task trains away
    ("18", "8", 0.0), ("-8", "8", 0.0), ("", "8", 0.0), ("eight", "8", 0.0), ("10", "10 ", 1.0),
])
def test_score_reads_the_first_number(response, label, expected):
    assert score(response, label) == expected


def test_reward_has_upstreams_async_signature_and_random_answers_score_as_counted(tmp_path):
    rng = random.Random(0)
    samples = [Sample(index=i, prompt="p", response=str(rng.randint(0, 18)), label=str(rng.randint(0, 18)))
               for i in range(64)]
    got = [asyncio.run(reward(None, s)) for s in samples]
    assert got == [float(s.response == s.label) for s in samples]
    main(["--out", str(tmp_path / "d.jsonl"), "--num", "7", "--seed", "2"])
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == make_dataset(7, seed=2) and not (tmp_path / "d.jsonl.tmp").exists()
