"""The trainer at world > 1 over gloo (ranks spawned here): one RL train step of the real trainer actor on a
fixed rollout batch of the tiny GLM-5 (float32; sequences longer than index_topk, so DSA drops keys) gives
the single-rank step's loss (rel 1e-5) and updated weights (every exported HF tensor: max |diff| / max |w| <=
1e-5) at DP2 with Megatron's distributed optimizer, alone, with full recompute, with CPU optimizer offload
(HybridDeviceOptimizer, precision-aware) and with overlapped grad reduce / param gather; and at TP2, EP2 and
TP2 x EP2 with the distributed optimizer. The single-rank reference runs the plain optimizer."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.multiprocessing as mp

from glm5_helpers import write_checkpoint
from slime.utils.net import free_port


def fixed_rollout_batch(n: int = 8, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tokens, resp, masks, adv = [], [], [], []
    for i in range(n):
        length = rng.randint(10, 16)  # > index_topk (8): DSA keeps 8 keys per query
        r = rng.randint(3, 7)
        tokens.append([rng.randrange(3, 512) for _ in range(length)])
        resp.append(r)
        masks.append([1] + [int(rng.random() > 0.2) for _ in range(r - 1)])
        adv.append(torch.full((r,), 1.0 if i % 2 else -1.0) * (0.5 + rng.random()))
    return dict(tokens=tokens, response_lengths=resp, rewards=[float(i % 2) for i in range(n)], loss_masks=masks,
                advantages=adv, reuse_train_log_probs=True)


def _spawn(world: int, names: list[str], ckpt: str, batch: str, out: str) -> None:
    from trainer_parallel_worker import run

    mp.spawn(run, args=(world, free_port(), ckpt, batch, out, names), nprocs=world, join=True)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


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
    moved = max(_max_rel(ref["weights"][n], initial[n]) for n in initial)
    assert moved > 1e-3, moved
    for name in [*two, "tp2ep2_distopt"]:
        got = torch.load(os.path.join(out, f"{name}.pt"))
        assert got["optimizer"] == "DistributedOptimizer", name
        if "offload" in name:
            assert got["inner"] == "HybridDeviceOptimizer", name
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), name
        assert got["weights"].keys() == ref["weights"].keys(), name
        worst = max(ref["weights"], key=lambda n: _max_rel(got["weights"][n], ref["weights"][n]))
        err = _max_rel(got["weights"][worst], ref["weights"][worst])
        assert err <= 1e-5, f"{name}: updated {worst} differs from the single-rank step by {err:.3g} (rel)"
