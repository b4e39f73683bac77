"""`EngineHealthMonitor`: upstream's --use-fault-tolerance health-check loop over the rollout engines.

A thread of the rollout manager. Active while engines generate (resumed when a rollout or an evaluation starts,
paused when the engines are offloaded or a weight sync begins: an offloaded or syncing engine may not answer),
it asks every engine's /health_generate each --rollout-health-check-interval seconds, after a grace period of
--rollout-health-check-first-wait seconds per resume. An engine that fails to answer within
--rollout-health-check-timeout (dead, or alive but hung) is handed to `on_failure`, which stops it, restarts it
and re-syncs the trainer's weights (the rollout manager's restart path, also used when a request fails).

Requests sent to a hung engine would otherwise wait for --rollout-request-timeout; a dead engine is restarted
even while no request is in flight.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class EngineHealthMonitor:
    def __init__(self, num_engines: int, check: Callable[[int, float], None],
                 on_failure: Callable[[int, object, str], None], interval: float, timeout: float,
                 first_wait: float = 0.0) -> None:
        """check(idx, timeout) returns when engine idx answered in time; raises HealthCheckFailed(reason, token)
        (token: the engine's restart count before the check) when not, SKIP for an engine not to check.
        on_failure(idx, token, reason) restarts engine idx unless it was restarted since `token`."""
        self.num_engines = num_engines
        self._check, self._on_failure = check, on_failure
        self.interval, self.timeout, self.first_wait = float(interval), float(timeout), float(first_wait)
        self._cond = threading.Condition()
        self._active = False
        self._stopped = False
        self._epoch = 0  # bumped by every resume: a first wait restarts, a round in progress ends
        self._thread: threading.Thread | None = None
        self.checks = 0
        self.failures = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """The thread starts paused."""
        if self._thread is None and self.num_engines:
            self._thread = threading.Thread(target=self._loop, name="engine-health-monitor", daemon=True)
            self._thread.start()

    def resume(self) -> None:
        with self._cond:
            self._active = True
            self._epoch += 1
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._active = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
            self._thread = None

    @property
    def active(self) -> bool:
        return self._active and not self._stopped

    # ------------------------------------------------------------------ loop
    def _sleep(self, seconds: float, epoch: int) -> bool:
        """Wait `seconds`; False when paused, stopped or resumed again meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: not self.active or self._epoch != epoch, timeout=seconds)
            return self.active and self._epoch == epoch

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._active)
                if self._stopped:
                    return
                epoch = self._epoch
            if self.first_wait > 0 and not self._sleep(self.first_wait, epoch):
                continue
            while self._round(epoch) and self._sleep(self.interval, epoch):
                pass

    def _round(self, epoch: int) -> bool:
        for idx in range(self.num_engines):
            if not self.active or self._epoch != epoch:
                return False
            self.checks += 1
            try:
                self._check(idx, self.timeout)
            except _Skip:
                continue
            except Exception as e:  # noqa: BLE001 - any failure to answer counts
                token = getattr(e, "token", None)
                if not self.active:
                    return False  # paused while it checked (an offload or a sync began): not a failure
                self.failures += 1
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                logger.error("health check: rollout engine %d did not answer /health_generate within %.1fs (%s); "
                             "stopping and restarting it", idx, self.timeout, reason)
                try:
                    self._on_failure(idx, token, reason)
                except Exception as err:  # noqa: BLE001 - the loop goes on; requests report what is left
                    logger.error("health check: restarting rollout engine %d failed: %s", idx, err)
        return True


class _Skip(Exception):
    """Raised by a check for an engine that is not to be checked (down for good)."""


class HealthCheckFailed(Exception):
    def __init__(self, message: str, token: object) -> None:
        super().__init__(message)
        self.token = token


SKIP = _Skip
