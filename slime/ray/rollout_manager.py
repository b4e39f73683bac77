"""`RolloutManager`: a Ray actor that owns the rollout engines, routes requests across them, reads
prompts, runs `generate_rollout` and restarts engines that die.

What the trainer uses: `engines()` ({"url", "tp_size", "token", "instance"} per running engine, asked
before every weight sync so a restarted engine (new process, maybe a new port) is picked up),
`engine_urls()`, `token()`, `generate(rollout_id)` -> {"samples", "metrics"}, `pause()`/`resume()`,
`flush_cache()`, `offload()`/`onload()` (engine memory), `state()`/`load_state()` (data source, saved
with checkpoints), `shutdown()`.

Engine death: a request that cannot reach its engine makes the manager look at the engine's
process; it logs (and keeps in `failures()`) which engine died, its exit code and log tail,
restarts it (at most `--rollout-engine-max-restarts` times) and the lost requests are re-issued.
A restarted engine serves the checkpoint's initial weights; when the run is past them it is kept out
of routing until it holds the run's weights again: with the trainer registered (`set_weight_source`),
the manager has the trainer push its current weights to that engine at once (the usual sync path,
checksum-verified), else the trainer's next sync does. Metrics: rollout/engine_restarts,
rollout/engine_restart_seconds (from the failure to the engine serving again), rollout/engine_resyncs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading
import time
from typing import Any

from slime.accelerator import get_accelerator
from slime.rollout.generate import EngineFleet, RolloutError, _Counters, generate_rollout
from slime.rollout.rewards import reward_value
from slime.rollout.router import Router
from slime.utils.http_client import EngineClient, EngineError

logger = logging.getLogger(__name__)


def resolve_engine_kind(args: Any) -> str:
    """The engine that runs: --rollout-engine as the configuration resolved it before Ray ("auto" decided once,
    args.rollout_engine_kind); SGLang must be installed where the manager runs."""
    from slime.backends.sglang.launcher import sglang_available

    kind = args.rollout_engine_kind
    if kind == "sglang" and not sglang_available():
        raise RolloutError("--rollout-engine sglang but sglang is not installed; install it or use --rollout-engine embedded")
    return kind


class RolloutManager(EngineFleet):
    memory_is_host = False  # set at start-up from the engines' answer (see __init__)

    def __init__(self, args: Any, slots: Any = None) -> None:
        from transformers import AutoTokenizer

        from slime.rollout.rewards import get_reward_fn

        if args.sglang_launch_args is None:  # what validation fills in
            raise RolloutError("the rollout flags were not validated: build args with slime.config.arguments."
                               "parse_args (or slime.config.rollout_args.validate_rollout_args)")
        self.args = args
        if not args.hf_checkpoint:
            raise RolloutError("--hf-checkpoint is required: the engines load it and its tokenizer encodes prompts")
        self._token = secrets.token_hex(16)
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.reward_fn = get_reward_fn(args) if (args.rm_type or args.custom_rm_path) else None
        if args.http_proxy or args.use_distributed_post:  # the built-in loop's reward posts go through http_utils too
            from slime.utils.http_utils import init_http_client

            init_http_client(args)
        self.data_source = self._make_data_source()
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
        self._generation = [0] * self.n
        self._restarts = [0] * self.n
        self._down: set[int] = set()  # restarts used up or failed: left out of engines()
        self._versions: list[str | None] = [None] * self.n
        self._stale: set[int] = set()
        self._engine_locks = [threading.Lock() for _ in range(self.n)]
        self._fleet_lock = threading.Lock()  # behind sglang-router: one recovery at a time for the whole fleet
        self._failures: list[dict[str, Any]] = []
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._progress: _Counters | None = None
        self._rollout_id: int | None = None
        self._trainer: list = []  # trainer rank actors: a restarted engine gets their weights (set_weight_source)
        self._offload_train = False
        self._restart_seconds = 0.0
        self._resyncs = 0
        self._eval_sets = None  # loaded on the first eval
        self._health_restarts = 0
        self._serving = 0  # rollouts / evaluations running: a restarted engine is re-synced at once only then
        self.health_monitor = self._start_health_monitor()
        logger.info("%d %s rollout engine(s) up: %s (logs in %s)", self.n, self.kind, self.urls, self.log_dir)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _ray():
        import ray

        return ray

    def _make_data_source(self):
        from slime.rollout.data_source import prompt_source

        if not self.args.rollout_global_dataset:  # --disable-rollout-global-dataset: the rollout function's data
            return None
        return prompt_source(self.args, self.tokenizer) if self.args.prompt_data else None

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

    def _start_health_monitor(self):
        """--use-fault-tolerance: the health-check loop (slime.ray.health_monitor), paused until a rollout starts."""
        if not self.args.use_fault_tolerance or not self.n:
            return None
        from slime.ray.health_monitor import EngineHealthMonitor

        a = self.args
        monitor = EngineHealthMonitor(self.n, self._health_check, self._restart_unhealthy,
                                      a.rollout_health_check_interval, a.rollout_health_check_timeout,
                                      a.rollout_health_check_first_wait)
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
    def _generating(self):
        self._serving += 1
        try:
            yield
        finally:
            self._serving -= 1

    def _health_resume(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.resume()

    def _health_pause(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.pause()

    # ------------------------------------------------------------------ trainer API
    def ready(self) -> bool:
        return True

    def token(self) -> str:
        return self._token

    def engine_urls(self) -> list[str]:
        return list(self.urls)

    def engines(self) -> list[dict[str, Any]]:
        """Running engines for weight sync; `instance` changes whenever the engine process was restarted."""
        colocated = bool(self.args.colocate)
        return [{"url": u, "tp_size": self.tp, "token": self._token, "instance": self._restarts[i],
                 # colocated: engine i's TP rank j shares bundle (device) i*tp + j with that trainer rank
                 "trainer_ranks": [i * self.tp + j for j in range(self.tp)] if colocated else None,
                 # a distributed weight update: the embedded engine joins with its rank 0 only (tensor_parallel.py)
                 "group_ranks": 1 if self.kind == "embedded" else self.tp,
                 "kind": self.kind}  # the resolved --rollout-engine (the weight sync sends SGLang's MTP draft)
                for i, u in enumerate(self.urls) if i not in self._down]

    def generate(self, rollout_id: int, with_samples: bool = False, offload: bool = False) -> dict[str, Any]:
        """One rollout. The training data goes into Ray's object store as flat arrays ("data", an object
        reference for the trainer ranks; the caller never needs to fetch it); "metrics" include the reward
        and length summary. with_samples: also return the Sample objects (tests, tools). offload: then
        `offload()` the engines (--offload-rollout), in the same Ray call (metric time/rollout_offload)."""
        from slime.backends.megatron.rollout_data import pack_samples, payload_summary

        started, t_start = time.time(), time.perf_counter()
        with self._generating():
            samples, metrics = self._generate(rollout_id)
        from slime.rollout import debug_data

        debug_data.save_rollout(self.args.save_debug_rollout_data, samples, rollout_id)  # before packing (upstream)
        # wall-clock bounds and the engines' weight version, for loops that overlap rollout and training
        metrics.update({"rollout/start_time": started, "rollout/end_time": time.time(),
                        "rollout/weight_version": _common_version(samples)})
        from slime.rollout.plugin_rollout import log_rollout, post_process_rewards, train_data_payload

        payload = train_data_payload(self.args, samples)  # --custom-convert-samples-to-train-data-path
        if payload is None:
            payload = pack_samples(samples, self.args.reward_key)
            metrics.update(post_process_rewards(self.args, samples, payload))  # --custom-reward-post-process-path
        metrics.update(payload_summary(payload))
        from slime.rollout.rollout_metrics import rollout_metrics

        metrics.update(rollout_metrics(self.args, samples))  # --log-passrate, --log-multi-turn, ...
        metrics = log_rollout(self.args, rollout_id, samples, metrics, time.time() - started)
        # engines: the list after this rollout (restarts happen during one), for the weight sync that follows
        out = {"data": self._ray().put(payload), "num_samples": int(payload["response_lengths"].size),
               "metrics": metrics,
               "rollout_id": rollout_id, "engines": self.engines()}
        if with_samples:
            out["samples"] = samples
        # the manager's whole share of the call (rollout/generate_time is the part in generate_rollout)
        metrics["time/rollout_manager"] = time.perf_counter() - t_start
        if offload:
            t0 = time.perf_counter()
            self.offload()
            metrics["time/rollout_offload"] = time.perf_counter() - t0
        return out

    def generate_rollout(self, rollout_id: int) -> list:
        return self._generate(rollout_id)[0]

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Evaluation rollouts on --eval-prompt-data with the eval sampling flags (slime.rollout.evaluation)."""
        with self._generating():
            return self._eval(rollout_id)

    def _eval(self, rollout_id: int) -> dict[str, float]:
        from slime.rollout import plugin_rollout
        from slime.rollout.evaluation import evaluate, load_eval_sets
        from slime.rollout.sample_hooks import set_current_rollout_id

        set_current_rollout_id(rollout_id)  # what --rollout-sample-hook-path hooks get as rollout_id
        self._health_resume()
        if plugin_rollout.uses_plugin_eval(self.args):  # upstream's eval function contract
            self._refresh_versions()
            self._rollout_id = rollout_id
            url = self.sglang_router.url if self.sglang_router is not None else self.urls[0]
            args = plugin_rollout.plugin_args(self.args, url, self.n, self.clients)
            if getattr(self, "_plugin_data_source", None) is None:
                self._plugin_data_source = plugin_rollout.make_data_source(args, self.data_source, self.tokenizer)
            return plugin_rollout.run_plugin_eval(args, rollout_id, self._plugin_data_source)
        if self._eval_sets is None:
            self._eval_sets = load_eval_sets(self.args, self.tokenizer)
        self._refresh_versions()
        self._rollout_id = rollout_id
        data: dict = {}
        metrics = evaluate(self.args, self, self._eval_sets, self.tokenizer, self.reward_fn, data)
        from slime.rollout import debug_data

        debug_data.save_eval(self.args.save_debug_rollout_data, data, rollout_id)
        return plugin_rollout.log_eval(self.args, rollout_id, data, None, metrics)  # --custom-eval-rollout-log-...

    def _plugin_rollout(self, rollout_id: int):
        """Upstream's plugin contracts (slime.rollout.plugin_rollout): the rollout function gets args naming
        the router and upstream's data source (made once, over this manager's prompts)."""
        from slime.rollout import plugin_rollout

        url = self.sglang_router.url if self.sglang_router is not None else (self.urls[0] if self.urls else None)
        args = plugin_rollout.plugin_args(self.args, url, self.n, self.clients)
        if getattr(self, "_plugin_data_source", None) is None:
            self._plugin_data_source = plugin_rollout.make_data_source(args, self.data_source, self.tokenizer)
        return plugin_rollout.run_plugin_rollout(args, rollout_id, self._plugin_data_source)

    def _generate(self, rollout_id: int):
        from slime.rollout.plugin_rollout import uses_plugin_rollout

        if self.args.load_debug_rollout_data:  # replay: the saved samples instead of the engines' (upstream's)
            from slime.rollout import debug_data

            self._rollout_id = rollout_id
            return debug_data.load_rollout(self.args.load_debug_rollout_data, rollout_id,
                                           self.args.load_debug_rollout_data_subsample), {}
        plugin = uses_plugin_rollout(self.args)
        own_data = self.args.data_source_path or not self.args.rollout_global_dataset  # the plugin's own prompts
        if self.data_source is None and not (plugin and own_data):
            raise RolloutError("no prompts: pass --prompt-data")
        if not self.n and not plugin:
            raise RolloutError("--debug-train-only starts no rollout engine: replay saved rollouts with "
                               "--load-debug-rollout-data PATH, or name a --rollout-function-path that needs none "
                               "(e.g. slime.rollout.sft_rollout.generate_rollout)")
        self._refresh_versions()
        health = self._note_current_versions()
        self._rollout_id = rollout_id
        from slime.rollout.sample_hooks import set_current_rollout_id

        set_current_rollout_id(rollout_id)
        self._progress = _Counters()
        before = self._restart_counters()
        self._health_resume()  # until the engines are offloaded or the weight sync begins (upstream's window)
        if plugin:
            samples, metrics = self._plugin_rollout(rollout_id)
        else:
            samples, metrics = generate_rollout(self.args, self, self.data_source, self.tokenizer, self.reward_fn,
                                                self._progress, health=health)
        metrics.update(self._restart_metrics(before))
        if self.reward_fn is not None:
            rewards = [reward_value(s.reward, self.args.reward_key) for s in samples]
            metrics["rollout/raw_reward_mean"] = sum(rewards) / len(rewards)
        return samples, metrics

    def _restart_counters(self) -> tuple[int, float, int, int]:
        return sum(self._restarts), self._restart_seconds, self._resyncs, self._health_restarts

    def _restart_metrics(self, before: tuple[int, float, int, int]) -> dict[str, float]:
        restarts, seconds, resyncs, by_health = self._restart_counters()
        out = {"rollout/engine_restarts": float(restarts - before[0]),
               "rollout/engine_restart_seconds": seconds - before[1],
               "rollout/engine_resyncs": float(resyncs - before[2])}
        if self.health_monitor is not None:  # of those restarts, the ones the health checks started
            out["rollout/health_check_restarts"] = float(by_health - before[3])
        return out

    def set_weight_source(self, trainer_actors: list, offload_train: bool = False) -> None:
        """The trainer rank actors: an engine restarted during a rollout gets their current weights through
        their `update_weights` (they are idle while the rollout runs)."""
        self._trainer = list(trainer_actors)
        self._offload_train = bool(offload_train)

    def engines_memory_is_host(self) -> bool:
        """Whether the engines' memory is the host's (then offload()/onload() do nothing)."""
        return self.memory_is_host

    def check_engines(self, onload: bool = False) -> dict[str, Any]:
        """Between rollouts (before a weight sync): restart engines whose process died since; the sync that
        follows gives them the current weights. Returns {"engines": engines(), **restart metrics}.
        onload: first `onload()` the engines (--offload-rollout; one Ray call for both, and an engine that
        answered it is running: its process status is not asked again)."""
        answered: set[int] = set()
        extra: dict[str, float] = {}
        if onload and not self.memory_is_host:
            t0 = time.perf_counter()
            answered = self._each_reachable(lambda c: c.resume_memory_occupation())
            extra["time/rollout_onload"] = time.perf_counter() - t0
        self._health_pause()  # the sync begins: an engine busy loading weights must not count as hung
        before = self._restart_counters()
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
                    self._health_check(idx, float(self.args.rollout_health_check_timeout))
                except HealthCheckFailed as e:
                    logger.error("health check before the weight sync: rollout engine %d did not answer (%s); "
                                 "restarting it", idx, e)
                    self._restart_unhealthy(idx, e.token, str(e), resync=False)
        return {"engines": self.engines(), **self._restart_metrics(before), **extra}

    def progress(self) -> dict[str, Any]:
        p = self._progress
        return {"rollout_id": self._rollout_id, "done": p.done if p else 0, "reissued": p.reissued if p else 0}

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

    def flush_cache(self) -> None:
        for c in self.clients:
            c.flush_cache()

    # An engine that died while offloaded is skipped here: the weight sync that follows restarts it (within
    # --rollout-engine-max-restarts), and a restarted engine holds its memory already.
    # On host memory (memory_is_host) both are no-ops: the engines keep their weights between rollouts.
    def offload(self) -> None:
        self._health_pause()
        if not self.memory_is_host:
            self._each_reachable(lambda c: c.release_memory_occupation())

    def onload(self) -> None:
        if not self.memory_is_host:
            self._each_reachable(lambda c: c.resume_memory_occupation())

    def state(self) -> dict[str, Any] | None:
        return None if self.data_source is None else self.data_source.state_dict()

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.data_source is not None:
            self.data_source.load_state_dict(state)

    get_data_source_state = state
    load_data_source_state = load_state

    def failures(self) -> list[dict[str, Any]]:
        return list(self._failures)

    def engine_actors(self) -> list:
        return list(self.actors)

    def shutdown(self) -> None:
        ray = self._ray()
        if self.health_monitor is not None:
            self.health_monitor.stop()
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

    # ------------------------------------------------------------------ fleet (used by generate_rollout)
    def num_engines(self) -> int:
        return len(self.clients)  # generate_rollout sends each engine its share in one batched request

    def acquire(self) -> int:
        return self.router.acquire(timeout=float(self.args.rollout_engine_startup_timeout))

    def release(self, idx: int, served: bool) -> None:
        self.router.release(idx, served)

    def client(self, idx: int) -> EngineClient:
        return self.clients[idx]

    def routing(self) -> str:
        """One line for the driver's log: where generation requests go."""
        if self.sglang_router is not None:
            return f"rollout requests go through sglang-router at {self.sglang_router.url} ({self.n} engines registered)"
        why = ("--rollout-router in-process" if self.args.rollout_router == "in-process"
               else "the sglang-router package is not installed")
        return f"rollout requests are routed in-process ({why})"

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
        return sum(self._generation) if self.sglang_router is not None else self._generation[idx]

    def wait_unpaused(self) -> None:
        self._unpaused.wait()

    def note_version(self, idx: int, version: str | None) -> None:
        if version is not None:
            self._versions[idx] = version

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
                    self.sglang_router.wait_worker(self.urls[idx], min(120.0, float(self.args.rollout_engine_startup_timeout)))
                except RouterError as e:
                    raise RolloutError(f"rollout engine {idx} restarted but sglang-router does not take it: {e}") from e
            elif not on and self.urls[idx] in self.sglang_router.workers:
                self.sglang_router.remove_worker(self.urls[idx])

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
                  "rollout_id": self._rollout_id, "error": str(error), "report": report, "time": time.time()}
        self._failures.append(record)
        logger.error("rollout engine %d failed during rollout %s: %s", idx, self._rollout_id, report)
        if self._restarts[idx] >= int(self.args.rollout_engine_max_restarts):
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
        engine = [e for e in self.engines() if e["url"] == self.urls[idx]]
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

    def _note_current_versions(self) -> dict[int, Any]:
        """The weight version each serving engine holds now (the trainer synced it after the last rollout):
        an engine that dies before answering anything in this rollout is still known to be behind. Returns
        the engines' /health replies (the rollout's engine-time snapshot starts from them: no second /health)."""
        health: dict[int, Any] = {}
        for idx in range(self.n):
            if idx not in self._down and idx not in self._stale:
                self.note_version(idx, self._health_version(idx, health))
        return health

    def _refresh_versions(self) -> None:
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


def _common_version(samples) -> float:
    """The weight version every generation turn of the rollout ran on (a synced version number); -1 when the
    turns differ (an engine synced or restarted mid-rollout) or a version is not a number (initial weights)."""
    versions = {str(v) for s in samples for v in s.weight_versions}
    if len(versions) == 1 and next(iter(versions)).isdigit():
        return float(next(iter(versions)))
    return -1.0


def create_rollout_manager(args: Any, slots: Any = None):
    """Start the RolloutManager actor (and its engines); returns the actor handle once everything is up."""
    import ray

    manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=16).remote(args, slots)
    ray.get(manager.ready.remote())
    return manager
