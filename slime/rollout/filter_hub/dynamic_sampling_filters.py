"""Group filters for dynamic sampling (`--dynamic-sampling-filter-path`): `fn(args, samples, **kwargs) ->
DynamicFilterOutput` (a bool is accepted too), called once per prompt with all of its scored samples."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from slime.rollout.filter_hub.base_types import DynamicFilterOutput

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def check_reward_nonzero_std(args: Any, samples: Sequence[Any], **kwargs: Any) -> DynamicFilterOutput:
    """Keep groups whose rewards are not all equal (DAPO's dynamic sampling): an all-equal group has zero
    advantage under GRPO and teaches nothing. Dropped groups are counted as drop_zero_std_<reward>."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: Sequence[Any], **kwargs: Any) -> DynamicFilterOutput:
    """The same, but a rejected group is kept when the batch could not be filled otherwise."""
    out = check_reward_nonzero_std(args, samples, **kwargs)
    out.keep_when_insufficient = True
    return out
