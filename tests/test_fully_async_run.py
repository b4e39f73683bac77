"""upstream's examples/fully_async rollout function driving train.py for 3 iterations on CPU (tiny GLM-5
quick-start checkpoint, embedded engine behind the router, Ray): every rollout trains on
--rollout-batch-size groups from the worker that keeps generating between rollouts."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_CPU_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["rollout/samples"] == 8 and math.isfinite(r["train/loss"])
    assert any(r["train/grad_norm"] > 0 for r in records)
