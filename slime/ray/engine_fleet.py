"""The rollout engines as one fleet, owned by the rollout manager: their start (an engine actor per engine,
on the trainer's bundles or a placement group of their own), the sglang-router in front of them (or the
in-process router), what the trainer's weight sync asks of them (`engines()`, pause/resume, memory offload)
and what the generation loop asks (`slime.rollout.generate.EngineFleet`: pick an engine, report a lost
request). Engine death, restarts, re-sync and the health checks are the `EngineRecovery` the fleet owns
(`recovery`, slime.ray.engine_recovery), built with the fleet's engines once they run; the generation loop's
calls about a lost request (`report_failure`, `generation`, `note_version`) pass through to it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from typing import Any

from slime.accelerator import get_accelerator
from slime.ray.engine_recovery import EngineRecovery, RecoverySettings
from slime.rollout.errors import RolloutError
from slime.rollout.generate import EngineFleet
from slime.rollout.router import Router
from slime.utils.http_client import EngineClient

logger = logging.getLogger(__name__)


def resolve_engine_kind(args: Any) -> str:
    """The engine that runs: --rollout-engine as the configuration resolved it before Ray ("auto" decided once,
    args.rollout_engine_kind); SGLang must be installed where the manager runs."""
    from slime.backends.sglang.launcher import sglang_available

    kind = args.rollout_engine_kind
    if kind == "sglang" and not sglang_available():
        raise RolloutError("--rollout-engine sglang but sglang is not installed; install it or use --rollout-engine embedded")
    return kind


class RolloutEngines(EngineFleet):
    memory_is_host = False  # set at start-up from the engines' answer (see __init__)

    def __init__(self, args: Any, token: str, slots: Any = None) -> None:
        """Start the engines (none with --debug-train-only) and wait until each serves. token: the run's
        secret, which every engine request carries."""
        self.args, self._token = args, token
        self.kind = resolve_engine_kind(args)
        self.tp = int(args.rollout_num_gpus_per_engine)
        if self.kind == "embedded" and self.tp != 1 and (slots is None or not args.colocate):
            # over several devices it runs one process per device, on the trainer's bundles (engine_parts)
            raise RolloutError(f"the embedded engine splits over devices only colocated with the trainer; "
                               f"--rollout-num-gpus-per-engine {self.tp} without --colocate needs "
                               "--rollout-engine sglang (or set it to 1)")
        total = int(args.rollout_num_gpus or self.tp)
        if total % self.tp:
            raise RolloutError(f"--rollout-num-gpus {total} is not a multiple of --rollout-num-gpus-per-engine {self.tp}")
        self.n = 0 if args.debug_train_only else total // self.tp  # --debug-train-only: no engines at all
        self.log_dir = os.path.join(args.output_dir or tempfile.mkdtemp(prefix="slime-"), "engine_logs")
        self._pg = None
        self._proxy = None  # the plugins' address, started by the first plugin rollout (plugin_url)
        self.actors = [self._create_actor(i, slots) for i in range(self.n)]
        self.urls = self._ray().get([a.start.remote() for a in self.actors])
        self.clients = [EngineClient(u, self._token) for u in self.urls]
        # Whether the engines' memory is the host's (asked once, inside their actors): then offload()/onload()
        # release nothing the trainer could use (as the trainer ranks' own offload there, RayTrainGroup) and
        # skip their calls, two HTTP round trips per engine per iteration with --offload-rollout.
        self.memory_is_host = bool(self.actors) and all(
            self._ray().get([a.memory_is_host.remote() for a in self.actors]))
        self.router = Router(self.n) if self.n else None  # in-flight accounting per engine; see _start_router
        self.sglang_router, self._router_client = (self._start_router() if self.n else None), None
        if self.sglang_router is not None:
            self._router_client = EngineClient(self.sglang_router.url, self._token)
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.recovery = EngineRecovery(RecoverySettings.from_args(args), actors=self.actors, urls=self.urls,
                                       clients=self.clients, token=self._token, router=self.router,
                                       sglang_router=self.sglang_router, engines=self.engines)
        logger.info("%d %s rollout engine(s) up: %s (logs in %s)", self.n, self.kind, self.urls, self.log_dir)

    # ------------------------------------------------------------------ start-up
    @staticmethod
    def _ray():
        import ray

        return ray

    def _create_actor(self, i: int, slots: Any):
        from slime.ray.engine_actor import EngineSpec, RolloutEngineActor

        ray, a, acc = self._ray(), self.args, get_accelerator()
        device_ids: list[int] = []
        parts = []
        if slots is not None:
            # one process per node it spans (SGLang --nnodes) or per device (embedded TP); part 0 serves HTTP
            parts = slots.engine_parts(i, self.tp, per_device=self.kind == "embedded")
            options, ids = parts[0].options, parts[0].device_ids  # the part's devices, in its env
            device_ids = ids if acc.ray_resource else []
        else:
            options = self._own_placement(i)
        spec = EngineSpec(
            index=i, kind=self.kind, model_path=a.hf_checkpoint, token=self._token, log_dir=self.log_dir,
            tp_size=self.tp, device_ids=device_ids, startup_timeout=float(a.rollout_engine_startup_timeout),
            max_running_requests=a.sglang_max_running_requests, context_length=a.sglang_context_length,
            dtype=a.sglang_dtype, random_seed=(a.rollout_seed + i) if self.kind == "embedded" else None,
            sglang_args=list(a.sglang_launch_args),
            memory_saver=bool(a.offload_rollout or a.colocate),
            deterministic=bool(a.sglang_enable_deterministic_inference))
        if len(parts) <= 1:
            return ray.remote(RolloutEngineActor).options(**options).remote(spec)
        import dataclasses

        others = [ray.remote(RolloutEngineActor).options(**p.options).remote(dataclasses.replace(
            spec, nnodes=len(parts), node_rank=k, device_ids=p.device_ids if acc.ray_resource else []))
            for k, p in enumerate(parts) if k]
        spec.nnodes = len(parts)
        return ray.remote(RolloutEngineActor).options(**options).remote(spec, others)

    def _own_placement(self, i: int) -> dict[str, Any]:
        """Without the trainer's slots: one placement group, a bundle per engine (CPU bundles on CPU)."""
        ray = self._ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime.ray.placement_group import device_request

        resource = get_accelerator().ray_resource
        if self._pg is None:
            bundle = {"CPU": 1} if resource is None else {resource: self.tp, "CPU": 1}
            self._pg = placement_group([dict(bundle) for _ in range(self.n)], strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=120)
            if not ready:
                raise RolloutError(f"cannot place {self.n} rollout engines with {bundle} each (cluster: "
                                   f"{ray.cluster_resources()}); lower --rollout-num-gpus")
        return {"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=i), **device_request(self.tp)}

    def _start_router(self):
        """The real sglang-router in front of the engines (started here, or the one --sglang-router-ip/port name),
        as upstream; without the package (or with --rollout-router in-process) requests are routed here."""
        from slime.rollout.sglang_router import SGLangRouter, router_available

        a, mode = self.args, self.args.rollout_router or "auto"
        if mode == "in-process" or (mode == "auto" and not router_available()):
            logger.info("rollout requests are routed in-process (%s)", "--rollout-router in-process"
                        if mode == "in-process" else "the sglang-router package is not installed")
            return None
        if not router_available():
            raise RolloutError("--rollout-router sglang-router but the sglang-router package is not installed; "
                               "pip install sglang-router, or use --rollout-router in-process")
        timeout = float(a.rollout_engine_startup_timeout)
        if a.sglang_router_ip:
            router = SGLangRouter.external(a.sglang_router_ip, a.sglang_router_port, self.urls, timeout)
        else:
            from slime.backends.sglang.launcher import bind_host

            # --router-* as upstream passes them, then --sglang-router-request-timeout-secs (upstream's override)
            extra = list(a.router_launch_args) + ["--request-timeout-secs", str(a.sglang_router_request_timeout_secs)]
            router = SGLangRouter.start(self.urls, bind_host(), os.path.join(self.log_dir, "sglang-router.log"), timeout,
                                        api_key=self._token if self.kind == "sglang" else None, extra_args=extra)
        logger.info("rollout requests go through sglang-router at %s (%d engines registered)", router.url, self.n)
        return router

    # ------------------------------------------------------------------ what the trainer asks
    def engines(self) -> list[dict[str, Any]]:
        """Running engines for weight sync; `instance` changes whenever the engine process was restarted."""
        colocated = bool(self.args.colocate)
        return [{"url": u, "tp_size": self.tp, "token": self._token, "instance": self.recovery.restarts(i),
                 # colocated: engine i's TP rank j shares bundle (device) i*tp + j with that trainer rank
                 "trainer_ranks": [i * self.tp + j for j in range(self.tp)] if colocated else None,
                 # a distributed weight update: the embedded engine joins with its rank 0 only (tensor_parallel.py)
                 "group_ranks": 1 if self.kind == "embedded" else self.tp,
                 "kind": self.kind}  # the resolved --rollout-engine (the weight sync sends SGLang's MTP draft)
                for i, u in enumerate(self.urls) if not self.recovery.is_down(i)]

    def router_url(self) -> str | None:
        """The sglang-router's URL, else the first engine's (None: no engine)."""
        if self.sglang_router is not None:
            return self.sglang_router.url
        return self.urls[0] if self.urls else None

    def plugin_url(self, counters: Any) -> str | None:
        """Where upstream's plugins send requests (args.sglang_router_ip/port): the fleet proxy
        (slime.rollout.fleet_proxy), which spreads them over the engines (or sends them to the sglang-router)
        and re-sends a request lost to a dead engine once the fleet has restarted it, counting it in `counters`
        (the rollout's generate.RolloutCounters). None: no engine."""
        if not self.n:
            return None
        if self._proxy is None:
            from slime.backends.sglang.launcher import bind_host
            from slime.rollout.fleet_proxy import FleetProxy

            self._proxy = FleetProxy(self, bind_host(), float(self.args.rollout_request_timeout),
                                     lambda: [e["url"] for e in self.engines()])
            logger.info("plugin requests go to %s (in front of the engine fleet)", self._proxy.url)
        self._proxy.fatal = None  # a new rollout: engines restarted between rollouts serve again
        self._proxy.counters = counters
        return self._proxy.url

    def plugin_failure(self) -> RolloutError | None:
        """The error the fleet gave up with while serving plugin requests (then every later one failed)."""
        return None if self._proxy is None else self._proxy.fatal

    def routing(self) -> str:
        """One line for the driver's log: where generation requests go."""
        if self.sglang_router is not None:
            return f"rollout requests go through sglang-router at {self.sglang_router.url} ({self.n} engines registered)"
        why = ("--rollout-router in-process" if self.args.rollout_router == "in-process"
               else "the sglang-router package is not installed")
        return f"rollout requests are routed in-process ({why})"

    def pause(self, mode: str = "abort") -> None:
        """Stop sending; engines abort (re-issued after resume) or freeze ("in_place") their requests.
        An engine that cannot be reached is skipped: it is down, and comes back unpaused."""
        self._unpaused.clear()
        self._each_reachable(lambda c: c.pause_generation(mode))

    def resume(self) -> None:
        self._each_reachable(lambda c: c.continue_generation())
        self._unpaused.set()

    def _each_reachable(self, call) -> set[int]:
        """`call(client)` for every engine; returns the indices of those that answered."""
        from slime.utils.http_client import EngineUnreachable

        answered = set()
        for i, c in enumerate(self.clients):
            try:
                call(c)
                answered.add(i)
            except EngineUnreachable as e:
                logger.warning("rollout engine %d unreachable (%s); skipped", i, e.message)
        return answered

    def check_engines(self, onload: bool = False) -> dict[str, Any]:
        """Between rollouts (before a weight sync): restart engines whose process died since (the recovery's
        check); the sync that follows gives them the current weights. Returns {"engines": engines(), **restart
        metrics}. onload: first `onload()` the engines (--offload-rollout; one Ray call for both, and an engine
        that answered it is running: its process status is not asked again)."""
        answered: set[int] = set()
        extra: dict[str, float] = {}
        if onload and not self.memory_is_host:
            t0 = time.perf_counter()
            answered = self._each_reachable(lambda c: c.resume_memory_occupation())
            extra["time/rollout_onload"] = time.perf_counter() - t0
        metrics = self.recovery.check_engines(answered)
        return {"engines": self.engines(), **metrics, **extra}

    def flush_cache(self) -> None:
        for c in self.clients:
            c.flush_cache()

    # An engine that died while offloaded is skipped here: the weight sync that follows restarts it (within
    # --rollout-engine-max-restarts), and a restarted engine holds its memory already.
    # On host memory (memory_is_host) both are no-ops: the engines keep their weights between rollouts.
    def offload(self) -> None:
        self.recovery.health_pause()
        if not self.memory_is_host:
            self._each_reachable(lambda c: c.release_memory_occupation())

    def onload(self) -> None:
        if not self.memory_is_host:
            self._each_reachable(lambda c: c.resume_memory_occupation())

    def shutdown(self) -> None:
        ray = self._ray()
        self.recovery.stop()
        if self._proxy is not None:
            self._proxy.stop()
        if self.sglang_router is not None:
            self.sglang_router.stop()
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)
            if self._pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
                self._pg = None

    # ------------------------------------------------------------------ what the generation loop asks
    def num_engines(self) -> int:
        return len(self.clients)  # generate_rollout sends each engine its share in one batched request

    def acquire(self) -> int:
        return self.router.acquire(timeout=float(self.args.rollout_engine_startup_timeout))

    def release(self, idx: int, served: bool) -> None:
        self.router.release(idx, served)

    def client(self, idx: int) -> EngineClient:
        return self.clients[idx]

    def batched_requests(self) -> bool:
        """Whether a /generate request may carry several samples. sglang-router (0.3) forwards one
        sampling_params object per request, so through it a request carries a run of samples whose seeds are
        consecutive (generate.run_samples) with the first one's params: embedded engines seed item i of such a
        batch with seed + i, the samples' own seeds; SGLang uses the seed only with deterministic inference,
        and would then seed every item alike, so there each sample goes alone."""
        return (self._router_client is None or self.kind == "embedded"
                or not self.args.sglang_enable_deterministic_inference)

    def behind_router(self) -> bool:
        """Whether generation goes through sglang-router (its 5xx replies then mean an engine died)."""
        return self.sglang_router is not None

    def generation_client(self, idx: int) -> EngineClient:
        """Where generation requests go: the sglang-router when one is in front of the engines."""
        return self._router_client if self._router_client is not None else self.clients[idx]

    def generation(self, idx: int) -> int:
        """A token that changes when engine `idx` is restarted; behind sglang-router (which picks the engine)
        it changes when any engine is."""
        return self.recovery.generation(idx)

    def report_failure(self, idx: int, generation: int, error: BaseException, resync: bool = True) -> None:
        """A request could not reach engine `idx` (the recovery restarts it, or raises RolloutError)."""
        self.recovery.report_failure(idx, generation, error, resync)

    def note_version(self, idx: int, version: str | None) -> None:
        """The weight version engine `idx` answered a request with (the recovery compares a restarted one's)."""
        self.recovery.note_version(idx, version)

    def wait_unpaused(self) -> None:
        self._unpaused.wait()
