"""Group filters for dynamic sampling: `fn(args, samples) -> bool`, called once per prompt with all of
its `--n-samples-per-prompt` scored samples; False drops the group and another is generated
(`--over-sampling-batch-size` prompts per round) until `--rollout-batch-size` groups are kept."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def check_reward_nonzero_std(args: Any, samples: Sequence[Any], **kwargs: Any) -> bool:
    """Keep groups whose rewards are not all equal (DAPO's dynamic sampling): an all-equal group has zero
    advantage under GRPO and teaches nothing."""
    rewards = [float(s.reward) for s in samples]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 1e-6
