"""--use-fault-tolerance: the rollout manager's health-check loop (slime.ray.health_monitor).

- the loop itself, on fake engines: checks only while resumed, a first wait per resume, a failing engine handed
  to the restart with the generation it was checked at, nothing counted as a failure once paused;
- a real run with a frozen engine: tests/test_debug_modes.py (its full run).
"""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.timeout(60)


class _Fleet:
    def __init__(self, bad: set[int]) -> None:
        self.bad, self.calls, self.failed = bad, [], []
        self.lock = threading.Lock()

    def check(self, idx: int, timeout: float) -> None:
        from slime.ray.health_monitor import HealthCheckFailed

        with self.lock:
            self.calls.append((idx, time.monotonic()))
        if idx in self.bad:
            raise HealthCheckFailed("no answer", token=40 + idx)

    def on_failure(self, idx: int, token, reason: str) -> None:
        with self.lock:
            self.failed.append((idx, token, reason))
            self.bad.discard(idx)  # restarted


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_health_loop_checks_while_resumed_and_restarts_a_failed_engine():
    from slime.ray.health_monitor import EngineHealthMonitor

    fleet = _Fleet(bad={1})
    m = EngineHealthMonitor(3, fleet.check, fleet.on_failure, interval=0.05, timeout=1.0, first_wait=0.2)
    m.start()
    time.sleep(0.15)
    assert fleet.calls == []  # started paused
    t0 = time.monotonic()
    m.resume()
    _wait(lambda: len(fleet.calls) >= 6)
    assert fleet.calls[0][1] - t0 >= 0.19  # the first wait after a resume
    assert [c[0] for c in fleet.calls[:6]] == [0, 1, 2, 0, 1, 2]
    assert fleet.failed == [(1, 41, "no answer")] and m.failures == 1  # once: then it is healthy again
    m.pause()
    time.sleep(0.1)
    n = len(fleet.calls)
    time.sleep(0.2)
    assert len(fleet.calls) == n  # paused: no checks
    m.stop()
    assert m._thread is None


def test_a_check_that_fails_after_a_pause_is_not_a_failure():
    from slime.ray.health_monitor import EngineHealthMonitor, HealthCheckFailed

    holder = {}

    def check(idx, timeout):
        holder["m"].pause()  # an offload began while the engine was being asked
        raise HealthCheckFailed("busy", token=0)

    failed = []
    m = holder["m"] = EngineHealthMonitor(1, check, lambda *a: failed.append(a), interval=0.01, timeout=1.0)
    m.start()
    m.resume()
    _wait(lambda: m.checks >= 1)
    time.sleep(0.05)
    m.stop()
    assert failed == [] and m.failures == 0
