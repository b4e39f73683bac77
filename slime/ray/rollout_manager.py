"""`RolloutManager`: the Ray actor of the rollout side. It owns the engine fleet (slime.ray.engine_fleet:
start, routing, memory; its `recovery`, slime.ray.engine_recovery: engine death, restarts, re-sync, health checks) and the
data path (slime.rollout.data_path: prompts, rollouts, rewards, the trainer's payload, evaluation), and
delegates each call to one of them.

What the trainer uses: `engines()` ({"url", "tp_size", "token", "instance"} per running engine, asked
before every weight sync so a restarted engine (new process, maybe a new port) is picked up),
`engine_urls()`, `token()`, `generate(rollout_id)` -> {"data", "metrics", ...}, `pause()`/`resume()`,
`flush_cache()`, `offload()`/`onload()` (engine memory), `check_engines()`, `set_weight_source()`,
`state()`/`load_state()` (data source, saved with checkpoints), `eval()`, `shutdown()`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from slime.ray.engine_fleet import RolloutEngines, resolve_engine_kind
from slime.rollout.data_path import RolloutDataPath
from slime.rollout.errors import RolloutError

__all__ = ["RolloutError", "RolloutManager", "create_rollout_manager", "resolve_engine_kind"]


class RolloutManager:
    def __init__(self, args: Any, slots: Any = None) -> None:
        if args.sglang_launch_args is None:  # what validation fills in
            raise RolloutError("the rollout flags were not validated: build args with slime.config.arguments."
                               "parse_args (or slime.config.rollout_args.validate_rollout_args)")
        self.args = args
        if not args.hf_checkpoint:
            raise RolloutError("--hf-checkpoint is required: the engines load it and its tokenizer encodes prompts")
        self._token = secrets.token_hex(16)  # every engine request carries it
        self.data = RolloutDataPath(args)  # the prompts first: a bad --prompt-data fails before any engine starts
        self.fleet = RolloutEngines(args, self._token, slots)

    @staticmethod
    def _ray():
        import ray

        return ray

    # What tools and tests read of a manager built in-process.
    n = property(lambda self: self.fleet.n)
    urls = property(lambda self: self.fleet.urls)
    log_dir = property(lambda self: self.fleet.log_dir)
    data_source = property(lambda self: self.data.data_source)

    # ------------------------------------------------------------------ the data path
    def ready(self) -> bool:
        return True

    def generate(self, rollout_id: int, with_samples: bool = False, offload: bool = False) -> dict[str, Any]:
        """One rollout. The training data goes into Ray's object store as flat arrays ("data", an object
        reference for the trainer ranks; the caller never needs to fetch it); "metrics" include the reward
        and length summary. with_samples: also return the Sample objects (tests, tools). offload: then
        `offload()` the engines (--offload-rollout), in the same Ray call (metric time/rollout_offload)."""
        started, t_start = time.time(), time.perf_counter()
        with self.fleet.recovery.serving():
            samples, metrics = self.data.rollout(rollout_id, self.fleet)
        payload, metrics = self.data.train_data(rollout_id, samples, metrics, started)
        # engines: the list after this rollout (restarts happen during one), for the weight sync that follows
        out = {"data": self._ray().put(payload), "num_samples": int(payload["response_lengths"].size),
               "metrics": metrics, "rollout_id": rollout_id, "engines": self.fleet.engines()}
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
        return self.data.rollout(rollout_id, self.fleet)[0]

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Evaluation rollouts on --eval-prompt-data with the eval sampling flags (slime.rollout.evaluation)."""
        with self.fleet.recovery.serving():
            return self.data.evaluate(rollout_id, self.fleet)

    def progress(self) -> dict[str, Any]:
        p = self.data.progress
        return {"rollout_id": self.fleet.recovery.rollout_id, "done": p.done if p else 0, "reissued": p.reissued if p else 0}

    def state(self) -> dict[str, Any] | None:
        return self.data.state()

    def load_state(self, state: dict[str, Any] | None) -> None:
        self.data.load_state(state)

    get_data_source_state = state
    load_data_source_state = load_state

    # ------------------------------------------------------------------ the engine fleet
    def token(self) -> str:
        return self._token

    def engine_urls(self) -> list[str]:
        return list(self.fleet.urls)

    def engines(self) -> list[dict[str, Any]]:
        """Running engines for weight sync; `instance` changes whenever the engine process was restarted."""
        return self.fleet.engines()

    def num_engines(self) -> int:
        return self.fleet.num_engines()

    def engine_actors(self) -> list:
        return list(self.fleet.actors)

    def engines_memory_is_host(self) -> bool:
        """Whether the engines' memory is the host's (then offload()/onload() do nothing)."""
        return self.fleet.memory_is_host

    def routing(self) -> str:
        """One line for the driver's log: where generation requests go."""
        return self.fleet.routing()

    def set_weight_source(self, trainer_actors: list, offload_train: bool = False) -> None:
        self.fleet.recovery.set_weight_source(trainer_actors, offload_train)

    def check_engines(self, onload: bool = False) -> dict[str, Any]:
        return self.fleet.check_engines(onload)

    def failures(self) -> list[dict[str, Any]]:
        return self.fleet.recovery.failures()

    def pause(self, mode: str = "abort") -> None:
        self.fleet.pause(mode)

    def resume(self) -> None:
        self.fleet.resume()

    def flush_cache(self) -> None:
        self.fleet.flush_cache()

    def offload(self) -> None:
        self.fleet.offload()

    def onload(self) -> None:
        self.fleet.onload()

    def shutdown(self) -> None:
        self.fleet.shutdown()


def create_rollout_manager(args: Any, slots: Any = None):
    """Start the RolloutManager actor (and its engines); returns the actor handle once everything is up."""
    import ray

    manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=16).remote(args, slots)
    ray.get(manager.ready.remote())
    return manager
