"""RolloutManager on Ray with two embedded engines (child processes) on CPU bundles."""

from __future__ import annotations

import time

import pytest

from rollout_manager_helpers import kill_engine_1_mid_rollout, two_engine_manager
from slime.utils.http_client import EngineClient

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    # logical CPUs: 2 engines + 1 behind the router
    with two_engine_manager(tmp_path_factory.mktemp("mgr"), 4, rollout_shuffle=True, rollout_batch_size=6) as m:
        yield m


def _check_rollout(result, args, first_index):
    from slime.rollout.sample import SampleStatus

    import ray

    from slime.backends.megatron.rollout_data import batch_from_payload

    samples = result["samples"]
    n = args.rollout_batch_size * args.n_samples_per_prompt
    # The trainer's copy (object store arrays) holds exactly the samples' fields, in the same order.
    batch = batch_from_payload(ray.get(result["data"]))
    assert result["num_samples"] == n and batch.tokens == [list(s.tokens) for s in samples]
    assert batch.rewards == [s.reward for s in samples] and batch.response_lengths == [s.response_length for s in samples]
    assert result["metrics"]["rollout/reward_mean"] == pytest.approx(sum(batch.rewards) / n)
    assert sorted(s.index for s in samples) == list(range(first_index, first_index + n))  # each exactly once
    groups = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert isinstance(s.reward, float) and 0.0 <= s.reward <= 1.0
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length == len(s.tokens) - s.prompt_length
        assert all(lp <= 0.0 for lp in s.rollout_log_probs)
    assert len(groups) == args.rollout_batch_size and all(len(g) == args.n_samples_per_prompt for g in groups.values())


def test_rollout_over_two_engines(manager):
    handle, args = manager
    engines = ray.get(handle.engines.remote())
    assert len(engines) == 2 and len({e["url"] for e in engines}) == 2
    assert all(e["token"] == ray.get(handle.token.remote()) and e["tp_size"] == 1 for e in engines)
    assert [e["instance"] for e in engines] == [0, 0]
    state = ray.get(handle.state.remote())
    result = ray.get(handle.generate.remote(0, with_samples=True), timeout=120)
    _check_rollout(result, args, 0)
    assert {s.engine_index for s in result["samples"]} == {0, 1}  # the router used both engines
    assert result["metrics"]["rollout/engine_restarts"] == 0
    # Data-source state: restoring it replays the same prompts.
    ray.get(handle.load_state.remote(state))
    again = ray.get(handle.generate.remote(0, with_samples=True), timeout=120)
    assert [s.prompt for s in again["samples"]] == [s.prompt for s in result["samples"]]
    # Same seeds, same weights: the same draws (engines are deterministic per request).
    assert [s.tokens for s in again["samples"]] == [s.tokens for s in result["samples"]]


def test_engine_death_mid_rollout_is_recovered(manager):
    handle, args = manager
    start = ray.get(handle.state.remote())["next_sample_index"]
    future, pid_before, actors = kill_engine_1_mid_rollout(handle, 1)
    result = ray.get(future, timeout=120)
    _check_rollout(result, args, start)
    failures = ray.get(handle.failures.remote())
    assert len(failures) == 1 and failures[0]["engine"] == 1 and failures[0]["exit_code"] == -9
    assert "rollout engine 1" in failures[0]["report"] and "killed by signal 9" in failures[0]["report"]
    assert "embedded engine serving" in failures[0]["report"]  # the log tail came along
    status = ray.get(actors[1].status.remote())
    assert status["running"] and status["starts"] == 2 and status["pid"] != pid_before
    assert result["metrics"]["rollout/engine_restarts"] == 1 and result["metrics"]["rollout/reissued_requests"] >= 1
    # The restarted engine serves again; the trainer's next engines() call sees its url and a new instance
    # (a new process: the weight sync re-forms a distributed group for it).
    assert ray.get(handle.engine_urls.remote())[1] == status["url"]
    engines = ray.get(handle.engines.remote())
    assert [e["url"] for e in engines] == ray.get(handle.engine_urls.remote()) and [e["instance"] for e in engines] == [0, 1]
    result = ray.get(handle.generate.remote(2, with_samples=True), timeout=120)
    _check_rollout(result, args, start + 24)


@pytest.mark.skipif(not __import__("slime.rollout.sglang_router", fromlist=["x"]).router_available(),
                    reason="sglang-router is not installed")
@pytest.mark.timeout(600)
def test_engine_death_behind_the_sglang_router_is_recovered(manager, tmp_path):
    """One engine behind the real sglang-router, killed with requests in flight: the router has no worker left
    and answers 5xx; the manager restarts the engine, registers it with the router again and the lost samples
    are generated again (same seeds: the same draws as a rollout without the failure)."""
    from slime.ray.rollout_manager import create_rollout_manager

    _, base_args = manager
    args = base_args.__class__(**{**vars(base_args), "rollout_router": "sglang-router", "rollout_num_gpus": 1,
                                  "rollout_batch_size": 2, "output_dir": str(tmp_path)})
    handle = create_rollout_manager(args)
    try:
        assert "sglang-router" in ray.get(handle.routing.remote())
        state = ray.get(handle.state.remote())
        clean = ray.get(handle.generate.remote(0, with_samples=True), timeout=120)
        ray.get(handle.load_state.remote(state))
        actor = ray.get(handle.engine_actors.remote())[0]
        client = EngineClient(ray.get(handle.engine_urls.remote())[0], ray.get(handle.token.remote()))
        client.pause_generation("in_place")
        future = handle.generate.remote(0, with_samples=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            load = client.get("/health")
            if load["num_queued_reqs"] + load["num_running_reqs"] > 0:
                break
            time.sleep(0.01)
        assert ray.get(actor.kill.remote()) == -9
        result = ray.get(future, timeout=300)
        assert [s.tokens for s in result["samples"]] == [s.tokens for s in clean["samples"]]
        assert result["metrics"]["rollout/engine_restarts"] == 1 and result["metrics"]["rollout/reissued_requests"] >= 1
        failures = ray.get(handle.failures.remote())
        assert len(failures) == 1 and failures[0]["exit_code"] == -9
        assert ray.get(actor.status.remote())["starts"] == 2
    finally:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle)
