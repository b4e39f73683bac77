"""What a rollout function returns (upstream slime's `slime.rollout.base_types`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]  # --rollout-batch-size groups of --n-samples-per-prompt samples
    metrics: dict[str, Any] | None = None  # logged with the rollout's metrics


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]  # per eval set: {"rewards": [...], "truncated": [...], "samples": [...]}
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Callable, *args: Any, evaluation: bool, **kwargs: Any):
    """fn(*args, evaluation=...) as a Train/Eval output; a bare list of groups (or eval dict) is wrapped."""
    out = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(out, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return out
    return RolloutFnEvalOutput(data=out) if evaluation else RolloutFnTrainOutput(samples=out)
