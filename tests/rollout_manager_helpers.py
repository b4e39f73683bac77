"""A RolloutManager on Ray over two embedded engines (child processes on CPU bundles), for the tests that start
one as a module fixture (test_rollout_manager.py, test_plugin_fleet.py), and the engine-death sequence they share."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator


@contextlib.contextmanager
def two_engine_manager(base, num_cpus: int, **overrides: Any) -> Iterator[tuple[Any, Any]]:
    """(handle, args) of a manager over two engines of the tiny GLM-5 checkpoint, 40 synthetic prompts and
    per-engine routing (the in-process router, so which engine served a request is known; the real
    sglang-router is exercised by tests/test_sglang_router.py and the e2e runs). Ray is started with `num_cpus`
    logical CPUs unless it runs already, and stopped again if started here."""
    import ray

    from slime.config.rollout_args import rollout_defaults, validate_rollout_args
    from slime.ray.rollout_manager import create_rollout_manager
    from slime.rollout.synthetic import main as write_dataset
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(str(base / "ckpt"), "glm_moe_dsa")
    data = base / "data.jsonl"
    write_dataset(["--out", str(data), "--num", "40"])
    settings = dict(hf_checkpoint=ckpt, prompt_data=str(data), apply_chat_template=True, n_samples_per_prompt=4,
                    rollout_max_response_len=6, rm_type="synthetic", rollout_num_gpus=2, max_concurrency=8,
                    output_dir=str(base / "out"), rollout_engine_max_restarts=1, rollout_router="in-process")
    args = validate_rollout_args(rollout_defaults(**{**settings, **overrides}))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        # a cluster of its own: a bare ray.init() joins one another process on the machine recorded
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    handle = create_rollout_manager(args)
    try:
        yield handle, args
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)
        if started:
            ray.shutdown()


def engine_clients(handle) -> list:
    import ray

    from slime.utils.http_client import EngineClient

    token = ray.get(handle.token.remote())
    return [EngineClient(u, token) for u in ray.get(handle.engine_urls.remote())]


def kill_engine_1_mid_rollout(handle, rollout_id: int):
    """Start rollout `rollout_id` with both engines frozen in place, so requests are provably in flight on engine
    1 when it is killed (SIGKILL, asserted), then let engine 0 go on. Returns (the rollout's future, engine 1's
    pid before, the engine actors)."""
    import ray

    actors = ray.get(handle.engine_actors.remote())
    pid_before = ray.get(actors[1].status.remote())["pid"]
    clients = engine_clients(handle)
    for c in clients:
        c.pause_generation("in_place")
    future = handle.generate.remote(rollout_id, with_samples=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        load = clients[1].get("/health")
        if load["num_queued_reqs"] + load["num_running_reqs"] > 0:
            break
        time.sleep(0.01)
    assert ray.get(actors[1].kill.remote()) == -9
    clients[0].continue_generation()
    return future, pid_before, actors
