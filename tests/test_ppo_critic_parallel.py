"""The PPO critic at world 2 over gloo (ranks spawned here) on the tiny GLM-5: at DP2 (distributed optimizer),
TP2 with sequence parallel (the value head gathers the sequence; its grads need no TP reduction) and PP2 (values
broadcast from the last stage), the critic's values before and after its optimizer step and the step's value
loss equal the single-rank ones (measured: values within 2.6e-06 rel, the loss within 7e-08)."""

from __future__ import annotations

import os

import pytest
import torch

from glm5_helpers import max_rel, rl_batch, spawn_ranks, write_checkpoint


@pytest.mark.timeout(600)
def test_critic_step_at_dp2_tp2_pp2_equals_single_rank(tmp_path):
    from ppo_critic_parallel_worker import run

    ckpt = write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3)
    batch = str(tmp_path / "batch.pt")
    fields = rl_batch(8, 1, lengths=(10, 16), responses=(3, 7))
    fields.pop("advantages")
    fields["reuse_train_log_probs"] = False
    torch.save(fields, batch)
    spawn_ranks(run, 1, ckpt, batch, str(tmp_path), ["single"])
    spawn_ranks(run, 2, ckpt, batch, str(tmp_path), ["dp2", "tp2_sp", "pp2"])
    ref = torch.load(os.path.join(tmp_path, "critic_single.pt"))
    moved = max(max_rel(a, b) for a, b in zip(ref["after"], ref["before"]))
    assert moved > 1.0, moved  # the step moves the values far beyond the tolerance below (measured 3.7)
    for name in ("dp2", "tp2_sp", "pp2"):
        got = torch.load(os.path.join(tmp_path, f"critic_{name}.pt"))
        assert got["value_loss"] == pytest.approx(ref["value_loss"], rel=1e-5), name
        for key in ("before", "after"):
            err = max(max_rel(a, b) for a, b in zip(got[key], ref[key]))
            assert err <= 1e-5, f"{name}: values {key} the step differ from the single rank's by {err:.3g} (rel)"
