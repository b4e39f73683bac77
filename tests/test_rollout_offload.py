"""--offload-rollout: the rollout manager releases and resumes the engines' memory where it is device memory,
and skips both where the engines' memory is the host's (their actors' answer at start-up)."""

from types import SimpleNamespace

import pytest


class _Client:
    def __init__(self, calls):
        self.calls = calls

    def release_memory_occupation(self, tags=None):
        self.calls.append("release")

    def resume_memory_occupation(self, tags=None):
        self.calls.append("resume")


class _Actor:
    def __init__(self, calls):
        self.status = SimpleNamespace(remote=lambda: calls.append("status") or {"running": True})


def _manager(memory_is_host: bool, calls: list):
    from slime.ray.engine_fleet import RolloutEngines
    from slime.ray.engine_recovery import EngineRecovery, RecoverySettings

    m = RolloutEngines.__new__(RolloutEngines)
    m.memory_is_host = memory_is_host
    m.n = 2
    m.clients = [_Client(calls) for _ in range(2)]
    m.actors = [_Actor(calls) for _ in range(2)]
    m.engines = lambda: ["e0", "e1"]
    settings = RecoverySettings(max_restarts=1, startup_timeout=60.0, health_checks=False, health_check_interval=30.0,
                                health_check_timeout=30.0, health_check_first_wait=0.0)
    m.recovery = EngineRecovery(settings, actors=m.actors, urls=["u0", "u1"], clients=m.clients, token="t",
                                router=None, sglang_router=None, engines=m.engines)
    m.recovery._ray = lambda: SimpleNamespace(get=lambda x: x)
    return m


@pytest.mark.parametrize("host", [False, True])
def test_offload_onload_skipped_on_host_memory(host):
    calls: list = []
    m = _manager(host, calls)
    m.offload()
    m.onload()
    assert calls == ([] if host else ["release"] * 2 + ["resume"] * 2)
    calls.clear()
    out = m.check_engines(onload=True)
    assert out["engines"] == ["e0", "e1"]
    # device memory: resumed, and an engine that answered is not asked its process status; host memory: the
    # status of every engine is asked (the only liveness check left), nothing resumed
    assert calls == (["status"] * 2 if host else ["resume"] * 2)
    assert ("time/rollout_onload" in out) is not host


def test_engine_actor_reports_the_accelerators_answer(monkeypatch):
    from slime.accelerator import get_accelerator
    from slime.ray.engine_actor import RolloutEngineActor

    acc = type(get_accelerator())
    for answer in (True, False):
        monkeypatch.setattr(acc, "memory_is_host", lambda self, a=answer: a)
        assert RolloutEngineActor.memory_is_host(object.__new__(RolloutEngineActor)) is answer
