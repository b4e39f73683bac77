"""slime.observability.rollout_metrics.log_rollout_data / log_eval_rollout_data against upstream's on the same calls
(tests/data/rollout_logging_cases.py; recorded by tests/data/record_upstream_rollout_logging_cases.py from upstream's
module at the commit it names): the record each sends to the trackers (keys and values, 1e-12 relative), its step
key, the return value, and the custom log functions' calls (a True answer stops the built-in record)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from slime.observability import rollout_metrics as rm
from test_upstream_rollout_metrics import build

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from rollout_logging_cases import run_all  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_rollout_logging_cases.json")) as f:
    RECORD = json.load(f)


@pytest.fixture(scope="module")
def ours():
    captured = []
    original = rm.send_to_trackers
    rm.send_to_trackers = lambda args, record, step_key: captured.append([dict(record), step_key])
    try:
        return json.loads(json.dumps(run_all(rm, build, captured)))
    finally:
        rm.send_to_trackers = original


def close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return a == b


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40 and len(RECORD["cases"]) == 10
    assert sum(bool(c["sent"]) for c in RECORD["cases"]) == 7 and sum(bool(c["calls"]) for c in RECORD["cases"]) == 4


@pytest.mark.parametrize("i", range(10))
def test_call_equals_upstream(ours, i):
    assert close(ours[i], RECORD["cases"][i]), (ours[i], RECORD["cases"][i])


def test_tensorboard_gets_the_record(tmp_path):
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = SimpleNamespace(use_wandb=True, use_tensorboard=True, tensorboard_dir=str(tmp_path), output_dir=None)
    rm.send_to_trackers(args, {"eval/a": 0.25, "eval/step": 3, "note": "text"}, "eval/step")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["eval/a"]
    assert [(e.step, e.value) for e in events.Scalars("eval/a")] == [(3, 0.25)]
