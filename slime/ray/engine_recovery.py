"""The engine fleet's fault tolerance: engine death, restarts within --rollout-engine-max-restarts, the
re-sync of a restarted engine's weights, and the health-check loop (--use-fault-tolerance).

A request that cannot reach its engine makes the fleet look at the engine's process; it logs (and keeps in
`failures()`) which engine died, its exit code and log tail, restarts it and the lost requests are re-issued
(slime.rollout.generate). A restarted engine serves the checkpoint's initial weights; when the run is past
them it is kept out of routing until it holds the run's weights again: with the trainer registered
(`set_weight_source`), the trainer pushes its current weights to that engine at once (the usual sync path,
checksum-verified), else the trainer's next sync does. Metrics: rollout/engine_restarts,
rollout/engine_restart_seconds (from the failure to the engine serving again), rollout/engine_resyncs,
rollout/health_check_restarts.

`EngineRecovery` is an object the fleet (`slime.ray.engine_fleet.RolloutEngines.recovery`) owns, built once the
engines run. It gets what it acts on: its flags (`RecoverySettings`), the fleet's engine actors, URLs and clients
(the fleet's own lists: a restart replaces an engine's URL and client in them), the run's token, the routers and
the fleet's `engines()` (the list a re-sync sends the weights to). It keeps the restart state, which the fleet
reads through `is_down`, `restarts` and `generation`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection

from slime.rollout.errors import RolloutError
from slime.utils.http_client import EngineClient, EngineError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoverySettings:
    """The flags fault tolerance reads."""

    max_restarts: int  # --rollout-engine-max-restarts, per engine
    startup_timeout: float  # --rollout-engine-startup-timeout (sglang-router's wait for a restarted worker)
    health_checks: bool  # --use-fault-tolerance
    health_check_interval: float  # --rollout-health-check-interval
    health_check_timeout: float  # --rollout-health-check-timeout
    health_check_first_wait: float  # --rollout-health-check-first-wait

    @classmethod
    def from_args(cls, args: Any) -> "RecoverySettings":
        return cls(max_restarts=int(args.rollout_engine_max_restarts),
                   startup_timeout=float(args.rollout_engine_startup_timeout),
                   health_checks=bool(args.use_fault_tolerance),
                   health_check_interval=float(args.rollout_health_check_interval),
                   health_check_timeout=float(args.rollout_health_check_timeout),
                   health_check_first_wait=float(args.rollout_health_check_first_wait))


class EngineRecovery:
    def __init__(self, settings: RecoverySettings, *, actors: list, urls: list[str], clients: list[EngineClient],
                 token: str, router: Any, sglang_router: Any, engines: Callable[[], list[dict[str, Any]]]) -> None:
        """actors, urls, clients: the fleet's lists, an entry per engine; router: the in-process Router (in-flight
        accounting, usable engines; None without engines); sglang_router: the SGLangRouter in front of the
        engines, or None; engines: the fleet's running engines as the weight sync takes them."""
        self.settings = settings
        self.actors, self.urls, self.clients, self._token = actors, urls, clients, token
        self.router, self.sglang_router, self._engines = router, sglang_router, engines
        self.n = len(actors)
        self._generation = [0] * self.n  # changes when the engine is restarted (requests compare it)
        self._restarts = [0] * self.n
        self._down: set[int] = set()  # restarts used up or failed: left out of engines()
        self._versions: list[str | None] = [None] * self.n  # the weight version the run expects of each
        self._stale: set[int] = set()  # restarted on older weights: out of routing until synced
        self._engine_locks = [threading.Lock() for _ in range(self.n)]
        self._fleet_lock = threading.Lock()  # behind sglang-router: one recovery at a time for the whole fleet
        self._failures: list[dict[str, Any]] = []
        self._trainer: list = []  # trainer rank actors: a restarted engine gets their weights (set_weight_source)
        self._offload_train = False
        self._restart_seconds = 0.0
        self._resyncs = 0
        self._health_restarts = 0
        self._serving = 0  # rollouts / evaluations running: a restarted engine is re-synced at once only then
        self.rollout_id: int | None = None  # the rollout in progress (named in failure records; the data path sets it)
        self.health_monitor = self._start_health_monitor()

    @staticmethod
    def _ray():
        import ray

        return ray

    # ------------------------------------------------------------------ what the fleet reads
    def is_down(self, idx: int) -> bool:
        """Restarts used up or failed: the engine is left out of the fleet's engines()."""
        return idx in self._down

    def restarts(self, idx: int) -> int:
        """How often engine `idx` was restarted (the `instance` of its engine-list entry)."""
        return self._restarts[idx]

    def generation(self, idx: int) -> int:
        """A token that changes when engine `idx` is restarted; behind sglang-router (which picks the engine)
        it changes when any engine is."""
        return sum(self._generation) if self.sglang_router is not None else self._generation[idx]

    def stop(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.stop()

    # ------------------------------------------------------------------ health checks (--use-fault-tolerance)
    def _start_health_monitor(self):
        """The health-check loop (slime.ray.health_monitor), paused until a rollout starts."""
        if not self.settings.health_checks or not self.n:
            return None
        from slime.ray.health_monitor import EngineHealthMonitor

        s = self.settings
        monitor = EngineHealthMonitor(self.n, self._health_check, self._restart_unhealthy, s.health_check_interval,
                                      s.health_check_timeout, s.health_check_first_wait)
        monitor.start()
        return monitor

    def _health_check(self, idx: int, timeout: float) -> None:
        from slime.ray.health_monitor import SKIP, HealthCheckFailed

        if idx in self._down:
            raise SKIP()
        token = self._generation[idx]
        try:
            self.clients[idx].get("/health_generate", timeout=timeout)
        except EngineError as e:
            raise HealthCheckFailed(getattr(e, "message", str(e)), token) from None

    def _restart_unhealthy(self, idx: int, token: int, reason: str, resync: bool = True) -> None:
        """The health monitor's failure: stop engine idx (it may be hung, not dead), restart it within
        --rollout-engine-max-restarts and re-sync the trainer's weights, unless a request's report restarted it
        since the check began (`token`, its restart generation then)."""
        fleet = self._fleet_lock if self.sglang_router is not None else contextlib.nullcontext()
        with fleet, self._engine_locks[idx]:
            if idx in self._down or self._generation[idx] != token:
                return
            self._ray().get(self.actors[idx].kill.remote())  # SIGKILL: a hung engine may ignore SIGTERM
            self._health_restarts += 1
            # between rollouts the trainer may be training: the sync that follows gives the weights
            self._restart(idx, RuntimeError(f"health check failed: {reason}"), resync=resync and self._serving > 0)

    @contextlib.contextmanager
    def serving(self):
        """Around a rollout or an evaluation: a restarted engine is re-synced at once (the trainer is idle)."""
        self._serving += 1
        try:
            yield
        finally:
            self._serving -= 1

    def health_resume(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.resume()

    def health_pause(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.pause()

    # ------------------------------------------------------------------ between rollouts
    def set_weight_source(self, trainer_actors: list, offload_train: bool = False) -> None:
        """The trainer rank actors: an engine restarted during a rollout gets their current weights through
        their `update_weights` (they are idle while the rollout runs)."""
        self._trainer = list(trainer_actors)
        self._offload_train = bool(offload_train)

    def check_engines(self, answered: Collection[int] = ()) -> dict[str, float]:
        """Between rollouts (before a weight sync): restart engines whose process died since; the sync that
        follows gives them the current weights. answered: engines that just answered a call (running: their
        process status is not asked again). Returns the restart metrics of this check."""
        self.health_pause()  # the sync begins: an engine busy loading weights must not count as hung
        before = self.restart_counters()
        for idx in range(self.n):
            if idx in self._down:
                continue
            status = {"running": True} if idx in answered else self._ray().get(self.actors[idx].status.remote())
            if not status["running"]:
                self._recover_engine(idx, self._generation[idx], RuntimeError("engine process not running"),
                                     resync=False)
            elif self.health_monitor is not None:  # running but hung: the sync would wait on it
                from slime.ray.health_monitor import HealthCheckFailed

                try:
                    self._health_check(idx, self.settings.health_check_timeout)
                except HealthCheckFailed as e:
                    logger.error("health check before the weight sync: rollout engine %d did not answer (%s); "
                                 "restarting it", idx, e)
                    self._restart_unhealthy(idx, e.token, str(e), resync=False)
        return self.restart_metrics(before)

    def restart_counters(self) -> tuple[int, float, int, int]:
        return sum(self._restarts), self._restart_seconds, self._resyncs, self._health_restarts

    def restart_metrics(self, before: tuple[int, float, int, int]) -> dict[str, float]:
        """rollout/engine_restarts, ... since `before` (a `restart_counters()`)."""
        restarts, seconds, resyncs, by_health = self.restart_counters()
        out = {"rollout/engine_restarts": float(restarts - before[0]),
               "rollout/engine_restart_seconds": seconds - before[1],
               "rollout/engine_resyncs": float(resyncs - before[2])}
        if self.health_monitor is not None:  # of those restarts, the ones the health checks started
            out["rollout/health_check_restarts"] = float(by_health - before[3])
        return out

    def failures(self) -> list[dict[str, Any]]:
        return list(self._failures)

    # ------------------------------------------------------------------ a request lost to an engine
    def report_failure(self, idx: int, generation: int, error: BaseException, resync: bool = True) -> None:
        """A request could not reach engine `idx` (behind sglang-router: some engine). Restart it once per failure
        (other threads that saw the same failure wait here, then retry); raise RolloutError when restarts are used
        up and no engine is left, or when the router failed a request although every engine is healthy."""
        if self.sglang_router is not None:
            return self._recover_behind_router(generation, error, resync)
        self._recover_engine(idx, generation, error, resync)

    def _recover_engine(self, idx: int, generation: int, error: BaseException, resync: bool) -> None:
        with self._engine_locks[idx]:
            if self._generation[idx] != generation:
                return  # already handled by another request's report
            self.router.set_usable(idx, False)
            if self._alive(idx):
                self.router.set_usable(idx, True)  # a transient connection error; the engine is fine
                return
            self._restart(idx, error, resync)

    def _recover_behind_router(self, generation: int, error: BaseException, resync: bool) -> None:
        """sglang-router answered 5xx (its worker died mid-request, or it has no live worker left): restart the
        engines that are down; it retries other workers itself, so a failure with every engine up is not ours to fix."""
        with self._fleet_lock:
            if sum(self._generation) != generation:
                return  # an engine was restarted since that request was sent: retry it
            # a busy engine may answer /health late: asked twice before it counts as hung (and is stopped)
            dead = [i for i in range(self.n) if i not in self._down and not self._alive(i, probes=2)]
            if not dead:
                if self.sglang_router.process is not None and not self.sglang_router.process.running():
                    raise RolloutError(f"sglang-router exited: {self.sglang_router.process.describe_exit()}")
                raise RolloutError(f"sglang-router at {self.sglang_router.url} failed a request while every engine "
                                   f"is healthy: {getattr(error, 'message', error)}")
            for i in dead:
                with self._engine_locks[i]:
                    self._restart(i, error, resync)

    def _alive(self, idx: int, probes: int = 1) -> bool:
        """Process running and answering /health (within `probes` tries of 10 s); an engine that runs but does
        not answer is stopped."""
        ray = self._ray()
        actor = self.actors[idx]
        status = ray.get(actor.status.remote())
        if status["running"] and any(self.clients[idx].health(timeout=10) for _ in range(probes)):
            return True
        if status["running"]:
            ray.get(actor.stop.remote())  # alive but not answering: treat as dead
        return False

    def _route(self, idx: int, on: bool) -> None:
        """Engine `idx` in or out of routing: the in-process router's accounting, and sglang-router's workers."""
        self.router.set_usable(idx, on)
        if self.sglang_router is not None:
            if on and self.urls[idx] not in self.sglang_router.workers:
                from slime.rollout.sglang_router import RouterError

                try:  # the router health-checks a new worker within seconds (--worker-startup-check-interval 1)
                    self.sglang_router.add_worker(self.urls[idx])
                    self.sglang_router.wait_worker(self.urls[idx], min(120.0, self.settings.startup_timeout))
                except RouterError as e:
                    raise RolloutError(f"rollout engine {idx} restarted but sglang-router does not take it: {e}") from e
            elif not on and self.urls[idx] in self.sglang_router.workers:
                self.sglang_router.remove_worker(self.urls[idx])

    # ------------------------------------------------------------------ restart and re-sync
    def _restart(self, idx: int, error: BaseException, resync: bool) -> None:
        """Engine `idx` is dead (caller holds its lock): record why, restart it within --rollout-engine-max-restarts
        and admit it once its weights are the run's (resync: the trainer pushes them now; otherwise the sync
        that follows does)."""
        ray = self._ray()
        t0 = time.perf_counter()
        self._route(idx, False)
        actor = self.actors[idx]
        report = ray.get(actor.describe_exit.remote())
        record = {"engine": idx, "url": self.urls[idx], "exit_code": ray.get(actor.status.remote())["exit_code"],
                  "rollout_id": self.rollout_id, "error": str(error), "report": report, "time": time.time()}
        self._failures.append(record)
        logger.error("rollout engine %d failed during rollout %s: %s", idx, self.rollout_id, report)
        if self._restarts[idx] >= self.settings.max_restarts:
            self._generation[idx] += 1
            self._down.add(idx)
            if not self.router.any_usable():
                raise RolloutError(f"rollout engine {idx} died and its {self._restarts[idx]} restarts are used up; "
                                   f"no engine left. {report}")
            logger.error("rollout engine %d stays down (restarts used up); continuing on the others", idx)
            return
        self._restarts[idx] += 1
        try:
            url = ray.get(actor.restart.remote())
        except Exception as e:
            self._generation[idx] += 1
            self._down.add(idx)
            if not self.router.any_usable():
                raise RolloutError(f"rollout engine {idx} could not be restarted: {e}") from e
            logger.error("rollout engine %d could not be restarted: %s", idx, e)
            return
        self.urls[idx] = url
        self.clients[idx] = EngineClient(url, self._token)
        try:
            self._admit_restarted(idx, resync)
        finally:
            self._generation[idx] += 1  # after admission: requests retried now find the engine routed again
            self._restart_seconds += time.perf_counter() - t0

    def _admit_restarted(self, idx: int, resync: bool = True) -> None:
        before = self._versions[idx]
        now = self._health_version(idx)
        if now is not None and before is not None and now != before and resync and self._trainer:
            now = self._resync(idx, before) or now
        if now is None:
            logger.warning("rollout engine %d: weight version unknown after restart; admitted as is", idx)
        elif before is not None and now != before:
            # Initial weights again while the run is at `before`: off-policy until the trainer syncs it.
            self._stale.add(idx)
            logger.error("rollout engine %d restarted with weight version %s (run is at %s): kept out of routing "
                         "until its weights are synced", idx, now, before)
            if resync and not self.router.any_usable():  # (between rollouts the sync that follows admits it)
                raise RolloutError(f"rollout engine {idx} restarted with its initial weights (version {now}) while "
                                   f"the run is at version {before}, and no other engine is up; sync weights and retry")
            return
        self._versions[idx] = now
        self._route(idx, True)

    def _resync(self, idx: int, version: str) -> str | None:
        """Have the trainer push its current weights (`version`) to restarted engine `idx` alone, verified
        by checksum like every sync; returns the engine's weight version afterwards (None if it failed)."""
        ray = self._ray()
        engine = [e for e in self._engines() if e["url"] == self.urls[idx]]
        try:
            if self._offload_train:
                ray.get([a.onload.remote() for a in self._trainer])
            replies = ray.get([a.update_weights.remote(int(version) if version.isdigit() else 0, engine)
                               for a in self._trainer])
            if self._offload_train:
                ray.get([a.offload.remote() for a in self._trainer])
        except Exception as e:
            logger.error("rollout engine %d: re-sync of the trainer's weights failed: %s", idx,
                         str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            return None
        self._resyncs += 1
        checked = int(replies[0].get("weight_sync/checked_tensors", 0))
        logger.warning("rollout engine %d restarted and re-synced to the trainer's weights (version %s, %d tensors "
                       "checksum-verified)", idx, version, checked)
        return self._health_version(idx)

    # ------------------------------------------------------------------ weight versions
    def note_version(self, idx: int, version: str | None) -> None:
        if version is not None:
            self._versions[idx] = version

    def _health_version(self, idx: int, health: dict[int, Any] | None = None) -> str | None:
        """The engine's weight version: in the embedded engine's /health reply, or SGLang's /get_weight_version.
        `health` (when given) keeps the /health reply under the engine's index."""
        for path in ("/health", "/get_weight_version"):
            try:
                reply = self.clients[idx].get(path, timeout=10)
            except EngineError:
                continue
            if health is not None and path == "/health":
                health[idx] = reply
            if isinstance(reply, dict) and reply.get("weight_version") is not None:
                return str(reply["weight_version"])
        return None

    def note_current_versions(self) -> dict[int, Any]:
        """The weight version each serving engine holds now (the trainer synced it after the last rollout):
        an engine that dies before answering anything in this rollout is still known to be behind. Returns
        the engines' /health replies (the rollout's engine-time snapshot starts from them: no second /health)."""
        health: dict[int, Any] = {}
        for idx in range(self.n):
            if idx not in self._down and idx not in self._stale:
                self.note_version(idx, self._health_version(idx, health))
        return health

    def refresh_versions(self) -> None:
        """Before a rollout: re-admit restarted engines whose weights the trainer has synced since."""
        if not self._stale:
            return
        current = {self._health_version(i) for i in range(self.n) if i not in self._stale}
        for idx in sorted(self._stale):
            v = self._health_version(idx)
            if v is not None and (v in current or not current):
                self._stale.discard(idx)
                self._versions[idx] = v
                self._route(idx, True)
