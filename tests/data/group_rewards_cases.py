"""Rollouts whose prompts' sample counts differ from --n-samples-per-prompt (a custom generate returning several
samples for a prompt, e.g. an agent session that forked, or none), and regular ones, for upstream's group reward
normalization (slime/ray/rollout.py `RolloutManager._post_process_rewards`), shared by
record_upstream_group_rewards_cases.py and tests/test_agent_fork_groups.py. Each case: the samples' rewards in
rollout order, --n-samples-per-prompt, --rollout-batch-size, the estimator and the normalization switches."""

from __future__ import annotations

import random


def _case(rewards, n, batch_size, estimator="grpo", std=True, normalize=True):
    return {"rewards": rewards, "n_samples_per_prompt": n, "rollout_batch_size": batch_size,
            "advantage_estimator": estimator, "grpo_std_normalization": std, "rewards_normalization": normalize}


def _random_cases(seed: int = 7) -> dict[str, dict]:
    rng, out = random.Random(seed), {}
    for k in range(6):
        n, batch_size = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
        counts = [n] * batch_size
        counts[rng.randrange(batch_size)] += rng.choice([-1, 1, 2])  # one prompt's session forked (or gave none)
        rewards = [rng.choice([0.0, 0.25, 1.0, -0.5]) for _ in range(sum(counts))]
        out[f"random_{k}"] = _case(rewards, n, batch_size, rng.choice(["grpo", "gspo", "cispo",
                                                                       "reinforce_plus_plus_baseline"]))
    return out


CASES = {
    "regular_groups": _case([1.0, 0.0, 0.5, 0.5, 0.0, 1.0], 3, 2),
    "one_session_forked": _case([1.0, 0.0, 1.0, 0.5, 0.0], 2, 2),  # the second sample's session gave two
    "fork_and_empty_add_up": _case([1.0, 0.0, 1.0, 0.25], 2, 2),  # one forked, one gave none: 4 = 2 x 2
    "divisible_but_not_the_batch": _case([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], 2, 2),
    "forked_without_std": _case([1.0, 0.0, 1.0, 0.5, 0.0], 2, 2, std=False),
    "forked_baseline": _case([1.0, 0.0, 1.0, 0.5, 0.0], 2, 2, "reinforce_plus_plus_baseline"),
    "forked_not_normalized": _case([1.0, 0.0, 1.0, 0.5, 0.0], 2, 2, normalize=False),
    "forked_ppo": _case([1.0, 0.0, 1.0], 2, 1, "ppo"),
    # tests/test_agent_fork_groups.py's two agent sessions of one prompt, the second forked in two samples
    "agent_session_forked": _case([1.0, 0.0, 0.0], 2, 1),
    **_random_cases(),
}
