"""The rollout side's one error type, below every rollout module (the generation loop, upstream's plugin path,
the rollout manager and its engine fleet all raise it; none imports another for it)."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """The rollout cannot complete. One line: which sample/engine and why (plus the engine's log tail)."""
