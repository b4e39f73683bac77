"""`--manual-gc`: the trainer's garbage-collection points chosen by the run instead of by Python's allocation
counters, so every rank collects at the same moments (a collection in the middle of one rank's step stalls
the others at the next collective). As upstream slime: the automatic collector is disabled and a full
collection runs at the start of each train call; as Megatron's loop: also one every `--manual-gc-interval`
optimizer steps when that is > 0."""

from __future__ import annotations

import gc


class ManualGC:
    def __init__(self, enabled: bool, interval: int = 0):
        if interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {interval}")
        self.enabled, self.interval, self.steps = bool(enabled), int(interval), 0

    @classmethod
    def from_args(cls, args) -> "ManualGC":
        return cls(args.manual_gc, args.manual_gc_interval)

    def train_start(self) -> None:
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_step(self) -> None:
        if not self.enabled:
            return
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            gc.collect()
