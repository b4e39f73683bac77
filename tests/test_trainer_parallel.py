"""The trainer at world > 1 over gloo (ranks spawned here): one RL train step of the real trainer actor on a
fixed rollout batch of the tiny GLM-5 (float32; sequences longer than index_topk, so DSA drops keys) gives
the single-rank step's loss (rel 1e-5) and updated weights (every exported HF tensor: max |diff| / max |w| <=
1e-5) at DP2 with Megatron's distributed optimizer, alone, with full recompute, with CPU optimizer offload
(HybridDeviceOptimizer, precision-aware) and with overlapped grad reduce / param gather; and at TP2, EP2 and
TP2 x EP2 with the distributed optimizer. The single-rank reference runs the plain optimizer."""

from __future__ import annotations

import os

import pytest
import torch

from glm5_helpers import max_rel, rl_batch, spawn_ranks, write_checkpoint


def fixed_rollout_batch() -> dict:
    return rl_batch(8, 0, lengths=(10, 16), responses=(3, 7))  # > index_topk (8): DSA keeps 8 keys per query


def _spawn(world: int, names: list[str], ckpt: str, batch: str, out: str) -> None:
    from trainer_parallel_worker import run

    spawn_ranks(run, world, ckpt, batch, out, names)


@pytest.mark.timeout(600)
def test_parallel_train_step_equals_single_rank(tmp_path):
    from safetensors.torch import load_file

    ckpt = write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3)
    batch = str(tmp_path / "batch.pt")
    torch.save(fixed_rollout_batch(), batch)
    out = str(tmp_path)
    _spawn(1, ["single"], ckpt, batch, out)
    two = ["dp2_distopt", "dp2_distopt_full_recompute", "dp2_distopt_cpu_offload", "dp2_distopt_overlap",
           "tp2_distopt", "ep2_distopt"]
    _spawn(2, two, ckpt, batch, out)
    _spawn(4, ["tp2ep2_distopt"], ckpt, batch, out)

    ref = torch.load(os.path.join(out, "single.pt"))
    assert ref["optimizer"] == "FP32Optimizer"
    initial = load_file(os.path.join(ckpt, "model.safetensors"))
    # The step moves the weights far beyond the tolerance, so equal weights mean an equal update.
    moved = max(max_rel(ref["weights"][n], initial[n]) for n in initial)
    assert moved > 1e-3, moved
    for name in [*two, "tp2ep2_distopt"]:
        got = torch.load(os.path.join(out, f"{name}.pt"))
        assert got["optimizer"] == "DistributedOptimizer", name
        if "offload" in name:
            assert got["inner"] == "HybridDeviceOptimizer", name
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), name
        assert got["weights"].keys() == ref["weights"].keys(), name
        worst = max(ref["weights"], key=lambda n: max_rel(got["weights"][n], ref["weights"][n]))
        err = max_rel(got["weights"][worst], ref["weights"][worst])
        assert err <= 1e-5, f"{name}: updated {worst} differs from the single-rank step by {err:.3g} (rel)"
