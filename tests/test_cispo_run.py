"""upstream's --advantage-estimator cispo through train.py on CPU (tiny GLM-5 quick-start checkpoint,
embedded engine, Ray): 3 RL iterations with CISPO's canonical wide clip (--eps-clip 1.0 --eps-clip-high 4.0,
which PPO's estimators refuse)."""

from __future__ import annotations

import math

import pytest

from logged_run import run_failure, run_train
from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)


def last_token_parity_reward(args, sample, **kwargs) -> float:
    """A reward the untrained tiny model's samples differ on (the copy task's is 0 for all of them)."""
    return float(sample.tokens[-1] % 2)


def test_cispo_trains_three_iterations(tmp_path):
    from glm5_helpers import write_run_inputs

    inputs = write_run_inputs(tmp_path, 16, (3, 3))
    out = tmp_path / "run"
    argv = ["--hf-checkpoint", inputs["model"], "--prompt-data", inputs["data"], "--apply-chat-template",
            "--custom-rm-path", "test_cispo_run.last_token_parity_reward",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
            "--lr", "5e-3", "--num-rollout", "3", "--colocate", "--num-cpus", "2", "--output-dir", str(out),
            "--advantage-estimator", "cispo", "--eps-clip", "1.0", "--eps-clip-high", "4.0"]
    proc = run_train(argv, timeout=280)
    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == [0, 1, 2], run_failure(proc)
    for r in records:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/pg_loss"])
    # At ratio 1 (one optimizer step per rollout) PPO's surrogate is -A, whose per-group mean is 0; CISPO's is
    # -A * log pi, which is not: a run whose groups' rewards differ shows it, with a gradient.
    assert any(abs(r["train/pg_loss"]) > 1e-6 and r["train/grad_norm"] > 0 for r in records), records


def test_only_cispo_takes_an_eps_clip_of_one_or_more(tmp_path, capsys):
    from slime.utils.arguments import parse_args

    base = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "1", "--global-batch-size", "1", "--eps-clip", "1.0"]
    args = parse_args(base + ["--advantage-estimator", "cispo", "--eps-clip-high", "4.0"])
    assert (args.advantage_estimator, args.eps_clip, args.eps_clip_high) == ("cispo", 1.0, 4.0)
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--advantage-estimator", "grpo"])
    assert e.value.code == 2 and "--eps-clip must be in (0, 1)" in capsys.readouterr().err
