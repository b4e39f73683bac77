"""Rollouts whose samples the trainer splits into optimizer steps: each sample's `Sample.rollout_id` (None: not
set, as a plain sample) and --global-batch-size. Upstream's split of each is recorded by
tests/data/record_upstream_rollout_steps_cases.py in tests/data/upstream_rollout_steps_cases.json."""

import random


def _forked(seed: int) -> dict:
    """Rollouts of 1-3 samples each (a forking agent session gives several), shuffled half of the time, some
    samples without a rollout id; a --global-batch-size that rarely divides the rollout count."""
    rng = random.Random(seed)
    ids: list = []
    for r in range(rng.randint(3, 9)):
        ids += [r * 10 + 7] * rng.randint(1, 3)
    if rng.random() < 0.5:
        rng.shuffle(ids)
    ids = [None if rng.random() < 0.2 else i for i in ids]
    return {"rollout_ids": ids, "global_batch_size": rng.randint(1, len(set(ids)))}


CASES = {
    "one_sample_per_rollout_divisible": {"rollout_ids": [None] * 8, "global_batch_size": 4},
    "one_sample_per_rollout_odd": {"rollout_ids": [None] * 7, "global_batch_size": 3},
    "agent_forks_contiguous": {"rollout_ids": [0, 0, 0, 1, 2, 2, 3, 4, 5], "global_batch_size": 2},
    "agent_forks_interleaved": {"rollout_ids": [3, 1, 3, 2, 1, 0, 0], "global_batch_size": 2},
    "ids_set_and_unset": {"rollout_ids": [None, 0, None, 2, None, 2, 5], "global_batch_size": 2},
    "one_step_per_rollout": {"rollout_ids": [4, 4, 9, 9, 9, 1], "global_batch_size": 1},
    **{f"forked_random_{seed}": _forked(seed) for seed in range(8)},
}
