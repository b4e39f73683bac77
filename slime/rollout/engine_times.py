"""The engines' own time over one rollout (rollout/engine_generate_time, engine_forward_time, engine_waves,
engine_joins), for the built-in transport of the generation loop (slime.rollout.generate)."""

from __future__ import annotations

import threading
from typing import Any


class EngineTimes:
    """Engine-side time of one rollout: differences of each engine's cumulative stats (the embedded engine
    reports them in /health), read before its first request of the rollout and after the last. Engines
    without stats (SGLang) or restarted during the rollout (counters start again) are left out."""

    def __init__(self, fleet: Any, health: dict[int, Any] | None = None) -> None:
        """health: /health replies the caller read from engines just before the rollout (the snapshot then
        starts from them instead of asking again)."""
        self.fleet = fleet
        self.lock = threading.Lock()
        self.before: dict[int, dict[str, float] | None] = {}
        self.health = dict(health or {})

    def first_use(self, idx: int) -> None:
        if idx in self.before:
            return
        with self.lock:  # the snapshot precedes every request of this rollout to the engine
            if idx not in self.before:
                given = self.health.pop(idx, None)
                self.before[idx] = (_stats_of(given) if given is not None
                                    else _engine_stats(self.fleet.client(idx)))

    def metrics(self) -> dict[str, float]:
        deltas = []
        for idx, before in self.before.items():
            after = _engine_stats(self.fleet.client(idx))
            if before is None or after is None or after.get("wave_seconds", 0.0) < before.get("wave_seconds", 0.0):
                continue
            deltas.append({k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in after})
        if not deltas:
            return {}
        # Engines generate in parallel: the busiest one bounds the rollout.
        return {"rollout/engine_generate_time": max(d.get("wave_seconds", 0.0) for d in deltas),
                "rollout/engine_forward_time": max(d.get("forward_seconds", 0.0) for d in deltas),
                "rollout/engine_waves": sum(d.get("waves", 0.0) for d in deltas),
                "rollout/engine_joins": sum(d.get("joins", 0.0) for d in deltas)}


def _engine_stats(client: Any) -> dict[str, float] | None:
    try:
        health = client.get("/health", timeout=10.0)
    except Exception:  # no stats (an engine without them, a stand-in client, an engine that is down)
        return None
    return _stats_of(health)


def _stats_of(health: Any) -> dict[str, float] | None:
    stats = health.get("stats") if isinstance(health, dict) else None
    return stats if isinstance(stats, dict) and "wave_seconds" in stats else None
