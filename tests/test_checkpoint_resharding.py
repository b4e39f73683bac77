"""torch_dist checkpoints reshard (2 trainer ranks over gloo, spawned here; float32, the tiny GLM-5 with MoE
and DSA dropping keys: prompt + response longer than index_topk). A checkpoint written at DP2 resumes at
TP2, one written at TP2 resumes at EP2 x DP1 (expert-data-parallel 1), and one written at PP2 resumes at
PP1 x TP2: the resumed rollout's rewards,
per-token old / reference log-probs (abs 1e-5), train metrics (loss, pg_loss, KL, entropy, grad norm; rel
1e-5) and the checkpoint written after its step (weights and Adam moments, rel 1e-5) equal those of the run
that continued without stopping. A resume with --no-load-optim must miss those moments (the check can fail).
Every save must find the same common (non-tensor) state on both ranks (dist_checkpointing's check logs
'common state dict differs' otherwise). See tests/checkpoint_reshard_worker.py."""

from __future__ import annotations

import json

import pytest
from rank_spawn import spawn

from slime.utils.net import free_port


def _resume_pairs(tmp_path, pairs=None, extra=()) -> None:
    """checkpoint_reshard_worker.run on 2 spawned ranks: the tiny GLM-5 checkpoint and 16 copy-task prompts."""
    from glm5_helpers import write_checkpoint
    from slime.rollout.synthetic import make_dataset

    ckpt = write_checkpoint(tmp_path / "model", "glm_moe_dsa", seed=4)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in make_dataset(16, seed=1, min_len=4, max_len=5)))
    from checkpoint_reshard_worker import PAIRS, run

    spawn(run, args=(free_port(), ckpt, str(data), str(tmp_path), pairs or PAIRS, extra), nprocs=2, join=True)


@pytest.mark.timeout(600)
def test_torch_dist_checkpoint_reshards_dp2_to_tp2_tp2_to_ep2_and_pp2_to_tp2(tmp_path):
    _resume_pairs(tmp_path)


@pytest.mark.timeout(400)
def test_torch_dist_checkpoint_written_at_cp2_resumes_at_cp1(tmp_path):
    """Context parallel shards no weights: a CP2 checkpoint (distributed optimizer sharded over DP x CP)
    resumes at CP1 x DP2 with the same next rollout (same checks as above)."""
    _resume_pairs(tmp_path, (("cp2", "dp2"),))


@pytest.mark.timeout(400)
def test_checkpoint_with_optimizer_cpu_offload_resumes_at_another_layout(tmp_path):
    """--optimizer-cpu-offload (HybridDeviceOptimizer, float32 params): a DP2 checkpoint resumes at TP2 with the
    same next rollout and the same checkpoint after its step (same checks as above)."""
    _resume_pairs(tmp_path, (("dp2", "tp2"),), ("--optimizer-cpu-offload",))


@pytest.mark.timeout(400)
def test_checkpoint_round_trips_bit_exact_through_pp2_tp2_ep2_and_the_distributed_optimizer(tmp_path):
    """Checkpoint level: DP2 -> PP2 -> TP2 (distributed optimizer) -> EP2 x DP2 (distributed optimizer,
    sharded over 2 ranks) -> DP2, each loading the previous checkpoint and saving it again: weights and
    Adam moments stay bit-identical."""
    from glm5_helpers import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "model", "glm_moe_dsa", seed=4)
    from checkpoint_reshard_worker import run_chain

    spawn(run_chain, args=(free_port(), ckpt, str(tmp_path)), nprocs=2, join=True)
