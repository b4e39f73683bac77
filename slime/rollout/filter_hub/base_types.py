"""The dynamic-sampling filter's answer (upstream slime's `slime.rollout.filter_hub.base_types`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # counted as rollout/dynamic_filter/drop_<reason>
    # keep a rejected group anyway when dropping it would leave too few groups to fill the batch
    keep_when_insufficient: bool = False

    def __bool__(self) -> bool:  # `if filter(args, group):` reads as keep
        return bool(self.keep)


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def call_dynamic_filter(fn: Callable | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """fn's answer as a DynamicFilterOutput (a bare bool is accepted); keep everything without a filter."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(*args, **kwargs)
    return out if isinstance(out, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(out))


class MetricGatherer:
    """Counts of dropped groups by reason."""

    def __init__(self) -> None:
        self._drops: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in self._drops.items()}
