"""upstream's examples/fully_async rollout function driving train.py for 3 iterations on CPU (tiny GLM-5
quick-start checkpoint, embedded engine behind the router, Ray): every rollout trains on
--rollout-batch-size groups from the worker that keeps generating between rollouts."""

from __future__ import annotations

import math

import pytest

from logged_run import run_failure, run_train
from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)


def test_fully_async_rollout_trains_three_iterations(tmp_path):
    from glm5_helpers import write_run_inputs

    inputs = write_run_inputs(tmp_path, 32, (3, 3))
    out = tmp_path / "run"
    argv = ["--hf-checkpoint", inputs["model"], "--prompt-data", inputs["data"], "--apply-chat-template",
            "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
            "--custom-rm-path", "test_cispo_run.last_token_parity_reward",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--sglang-server-concurrency", "2",
            "--rollout-max-response-len", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
            "--lr", "5e-3", "--num-rollout", "3", "--colocate", "--num-cpus", "2", "--output-dir", str(out)]
    proc = run_train(argv, timeout=280)
    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == [0, 1, 2], run_failure(proc)
    for r in records:
        assert r["rollout/samples"] == 8 and math.isfinite(r["train/loss"])
    assert any(r["train/grad_norm"] > 0 for r in records)
