"""A whole RL run with upstream's PPO-with-critic and on-policy-distillation flags through train.py on CPU
(tiny GLM-5 quick-start checkpoint, embedded engine, Ray): --advantage-estimator ppo with --num-critic-only-steps
1 and the critic's learning rate from --megatron-config-path, plus --use-opd --opd-type megatron with a teacher
checkpoint of the same architecture and other weights."""

from __future__ import annotations

import math

import pytest

from logged_run import run_train
from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)


def test_ppo_with_critic_and_opd_run(tmp_path):
    from glm5_helpers import write_run_inputs
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    inputs = write_run_inputs(tmp_path, 16, (3, 3))
    teacher = write_tiny_checkpoint(str(tmp_path / "teacher"), seed=1)
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - name: default\n    role: critic\n    overrides:\n      lr: 1e-2\n")
    out, save = tmp_path / "run", tmp_path / "save"
    argv = ["--hf-checkpoint", inputs["model"], "--prompt-data", inputs["data"], "--apply-chat-template",
            "--rm-type", "synthetic", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
            "--lr", "5e-3", "--num-rollout", "3", "--colocate", "--num-cpus", "2", "--output-dir", str(out),
            "--advantage-estimator", "ppo", "--num-critic-only-steps", "1", "--lambd", "0.95", "--gamma", "1.0",
            "--value-clip", "0.2", "--normalize-advantages", "--megatron-config-path", str(roles),
            "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher, "--opd-kl-coef", "1.0",
            "--save", str(save), "--save-interval", "3"]
    run_train(argv, timeout=280)  # fails the test on a non-zero exit
    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    for r in records:
        assert math.isfinite(r["critic/value_loss"]) and r["critic/value_loss"] >= 0
        assert r["critic/lr"] == pytest.approx(1e-2) and r["critic/grad_norm"] > 0
    first, *later = records
    assert first["train/actor_trained"] == 0.0 and "train/loss" not in first  # the critic-only rollout
    for r in later:
        assert math.isfinite(r["train/loss"]) and r["train/lr"] == pytest.approx(5e-3)
        assert math.isfinite(r["train/opd_reverse_kl"]) and r["train/opd_reverse_kl"] != 0.0  # teacher != student
    assert (save / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
