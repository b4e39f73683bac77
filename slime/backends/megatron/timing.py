"""Per-phase train timing from accelerator events: events are recorded at phase boundaries on the device
stream and read once, after the last one completes, so timing adds no synchronize() per phase and per
micro-batch (on CPU the events read the host clock; CPU work is synchronous)."""

from __future__ import annotations

from typing import Any


class PhaseTimer:
    def __init__(self, accelerator, phases: tuple[str, ...]) -> None:
        self._acc = accelerator
        self._spans: list[tuple[str, Any, Any]] = []
        self.phases = phases

    def mark(self) -> Any:
        """An event recorded now on the current stream."""
        event = self._acc.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: str, since: Any) -> Any:
        """Close the span of `phase` that began at event `since`; returns the end event (the next start)."""
        end = self.mark()
        self._spans.append((phase, since, end))
        return end

    def seconds(self) -> dict[str, float]:
        """Seconds per phase: waits once for the last recorded event, then sums the spans."""
        totals = dict.fromkeys(self.phases, 0.0)
        if self._spans:
            self._spans[-1][2].synchronize()
        for phase, start, end in self._spans:
            totals[phase] += start.elapsed_time(end) / 1000.0
        return totals
