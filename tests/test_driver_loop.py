"""The driver's share of an RL iteration is constant in the rollout size: the training loop (slime/train.py:_run)
against stand-in trainer ranks and rollout manager (Ray actors that move real sample arrays through the object
store), at 64 and 512 samples per rollout. The driver makes the same Ray calls per iteration and never receives
a sample array; its waits (slime.ray.waiting) do not wake up while the remote work runs, and signals still
interrupt them."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ray_session():
    import sys

    import ray

    from slime.ray.placement_group import init_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this file
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


class _Trainer:
    """A trainer rank: reads its rollout from the object store, as the Megatron ranks do."""

    def __init__(self, world, rank, master):
        self.rank = rank

    def get_master_addr_port(self):
        return ("127.0.0.1", 0)

    def init(self, args, role, with_ref):
        return 0

    def connect_rollout_engines(self, engines):
        return "ipc"

    def train_rollout(self, rollout_id, data, reuse):
        return {"train/loss": 0.0, "train/tokens": float(data["tokens"].size), "train_rollout_logprob_abs_diff": 0.0}

    def update_weights(self, version, engines):
        return {"time/weight_sync": 0.0}

    def save(self, rollout_id, extra):
        return {}

    def shutdown(self):
        pass


class _Rollout:
    """A rollout manager that packs `args.rollout_batch_size * n_samples_per_prompt` samples of 6 tokens."""

    def __init__(self, n):
        self.n = n

    def generate(self, rollout_id):
        import ray

        from slime.backends.megatron.rollout_data import payload_summary

        rng = np.random.default_rng(rollout_id)
        payload = {"tokens": rng.integers(0, 500, size=6 * self.n), "offsets": np.arange(0, 6 * self.n + 1, 6),
                   "response_lengths": np.full(self.n, 2), "rewards": rng.random(self.n),
                   "loss_masks": np.ones(2 * self.n, dtype=np.int8), "rollout_log_probs": None}
        return {"data": ray.put(payload), "num_samples": self.n, "metrics": payload_summary(payload)}

    def engines(self):
        return []

    def routing(self):
        return "in-process"

    def set_weight_source(self, actors, offload):
        pass

    def check_engines(self):
        return {"engines": [], "rollout/engine_restarts": 0.0}

    def state(self):
        return {}

    def shutdown(self):
        pass


class _Calls:
    """Counts the driver's Ray calls and checks what comes back to it."""

    def __init__(self, monkeypatch, n_samples):
        import ray

        self.n, self.count = n_samples, {"remote": 0, "get": 0, "put": 0}
        method_remote, get, put = ray.actor.ActorMethod.remote, ray.get, ray.put
        calls = self

        def remote(self_, *a, **k):
            calls.count["remote"] += 1
            return method_remote(self_, *a, **k)

        def counted_get(refs, *a, **k):
            calls.count["get"] += 1
            out = get(refs, *a, **k)
            calls.check(out)
            return out

        def counted_put(value, *a, **k):
            calls.count["put"] += 1
            return put(value, *a, **k)

        monkeypatch.setattr(ray.actor.ActorMethod, "remote", remote)
        monkeypatch.setattr(ray, "get", counted_get)
        monkeypatch.setattr(ray, "put", counted_put)

    def check(self, value):
        if isinstance(value, (np.ndarray, torch.Tensor)):
            raise AssertionError(f"the driver received an array of shape {tuple(value.shape)}")
        if isinstance(value, dict):
            for v in value.values():
                self.check(v)
        elif isinstance(value, (list, tuple)):
            assert len(value) < self.n, f"the driver received a sequence of {len(value)} items"
            for v in value:
                self.check(v)


def _args(tmp_path, n_samples: int, num_rollout: int):
    from slime.config.arguments import parse_args

    return parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", str(num_rollout),
                       "--rollout-batch-size", str(n_samples // 8), "--n-samples-per-prompt", "8",
                       "--global-batch-size", str(n_samples), "--actor-num-gpus-per-node", "2",
                       "--output-dir", str(tmp_path / f"out{n_samples}-{num_rollout}")])


def _loop_calls(tmp_path, monkeypatch, trainers, manager, n_samples: int, num_rollout: int) -> dict[str, int]:
    """The driver's Ray calls in one run of the loop on these stand-in ranks and manager (stateless: every run
    gets the same answers from them, so runs can share them)."""
    import slime.ray.rollout as rollout_module
    from slime import train

    args = _args(tmp_path, n_samples, num_rollout)
    trainers.args = args  # this run's arguments reach the ranks' init, as from a group built for it
    handles = {"actor": trainers}
    monkeypatch.setattr(rollout_module, "create_rollout_manager", lambda args, slots: manager)
    with monkeypatch.context() as m:
        calls = _Calls(m, n_samples)
        records = train._run(args, handles, {"rollout": None})
    assert len(records) == num_rollout and records[-1]["rollout/samples"] == n_samples
    return calls.count


def test_driver_ray_calls_per_iteration_do_not_depend_on_the_rollout_size(ray_session, tmp_path, monkeypatch):
    """Runs of 1 and 3 iterations at each size (set-up calls cancel out in the difference), on one group of two
    stand-in trainer ranks and one stand-in manager per size."""
    import ray

    from slime.ray.actor_group import RayTrainGroup

    class Slots(list):
        def actor_options(self, i, extra_env=None):
            return {"num_cpus": 0}

    trainers = RayTrainGroup(_args(tmp_path, 64, 1), Slots([0, 1]), actor_cls=ray.remote(_Trainer))
    managers = {n: ray.remote(_Rollout).options(num_cpus=0).remote(n) for n in (64, 512)}
    per_iteration = {}
    try:
        for n, manager in managers.items():
            one, three = (_loop_calls(tmp_path, monkeypatch, trainers, manager, n, k) for k in (1, 3))
            per_iteration[n] = {k: (three[k] - one[k]) / 2 for k in one}  # set-up calls cancel out
    finally:
        for a in trainers.actors + list(managers.values()):
            ray.kill(a)
    assert per_iteration[64] == per_iteration[512], per_iteration
    assert per_iteration[64]["put"] == 0 and per_iteration[64]["remote"] > 0


class _Sleeper:
    def sleep(self, s):
        time.sleep(s)
        return s

    def fail(self):
        raise ValueError("boom")


def test_wait_does_not_wake_while_the_remote_call_runs(ray_session, monkeypatch):
    """ray.get wakes every second to run signal handlers (CPU time growing with the wait); the driver's wait
    sleeps in select() until a result or a signal arrives: the same wake-ups for a short and a long call."""
    import ray

    from slime.ray import waiting

    actor = ray.remote(_Sleeper).options(num_cpus=0).remote()
    assert waiting.get(actor.sleep.remote(0)) == 0
    real_select, wakeups = waiting.select.select, []

    def counted(*a):
        wakeups.append(1)
        return real_select(*a)

    monkeypatch.setattr(waiting.select, "select", counted)
    seen = []
    for seconds in (0.05, 2.5):
        wakeups.clear()
        assert waiting.get([actor.sleep.remote(seconds), actor.sleep.remote(0)]) == [seconds, 0]
        seen.append(len(wakeups))
    assert 1 <= seen[1] <= 3, seen  # one per finished reference at most (plus a stale one), not one per second
    assert waiting.wait_ready([actor.sleep.remote(1.0)], timeout=0.01) is False
    with pytest.raises(ray.exceptions.GetTimeoutError):
        waiting.get(actor.sleep.remote(1.0), timeout=0.01)
    with pytest.raises(ValueError, match="boom"):
        waiting.get(actor.fail.remote())
    ray.kill(actor)


def test_a_signal_interrupts_the_wait(ray_session):
    import ray

    from slime.ray import waiting
    from slime.utils.exits import Interrupted, install_signal_handlers

    actor = ray.remote(_Sleeper).options(num_cpus=0).remote()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    install_signal_handlers()
    ref = actor.sleep.remote(60)
    try:  # sent from another thread: the kernel may deliver it to any thread of the process
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Interrupted):
            waiting.get(ref)
        assert not ray.wait([ref], timeout=0)[0]  # interrupted, not finished
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        ray.kill(actor)


def test_one_failed_rank_ends_the_wait_for_all(ray_session):
    """Trainer ranks wait on each other in collectives: when one fails the others may never finish, so the
    driver's wait raises that failure at once instead of waiting for every rank (a hang until their timeouts)."""
    import ray

    from slime.ray import waiting

    stuck, failing = (ray.remote(_Sleeper).options(num_cpus=0).remote() for _ in range(2))
    pending = stuck.sleep.remote(60)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        waiting.get([pending, failing.fail.remote()])
    assert time.monotonic() - t0 < 30  # not the 60 s of the rank that never finishes
    assert not ray.wait([pending], timeout=0)[0]
    assert waiting.get([failing.sleep.remote(0), failing.sleep.remote(0.1)]) == [0, 0.1]  # no error: all results
    for a in (stuck, failing):
        ray.kill(a)


class _EngineDiesInSync(_Trainer):
    """Its first sync of weight version 2 fails as when an engine dies in the middle of it."""

    failed = False

    def arm(self):
        """Fail again at the next sync of version 2 (a new case on the same actor)."""
        self.failed = False

    def update_weights(self, version, engines):
        if version == 2 and not self.failed:
            self.failed = True
            raise ConnectionError(f"engine {engines} unreachable")
        return {"time/weight_sync": 0.0, "weight_sync/engines": float(len(engines))}


class _RestartsOnCheck(_Rollout):
    """check_engines finds the dead engine (and restarts it: a new instance) on the check after the failure."""

    def __init__(self, n, restart):
        super().__init__(n)
        self.arm(restart)

    def arm(self, restart):
        """Count checks from zero again, restarting the engine or not (a new case on the same actor)."""
        self.checks, self.restart = 0, restart

    def check_engines(self):
        self.checks += 1
        restarted = self.restart and self.checks == 3  # rollout 0's check, rollout 1's, then after the failure
        return {"engines": [{"url": "http://127.0.0.1:1", "instance": int(self.checks >= 3)}],
                "rollout/engine_restarts": float(restarted)}


@pytest.fixture(scope="module")
def dying_sync(ray_session, tmp_path_factory):
    """One stand-in trainer rank whose sync of version 2 fails once, and one stand-in manager; each case below
    re-arms both (a fresh failure, checks counted from zero)."""
    import ray

    from slime.ray.actor_group import RayTrainGroup

    class Slots(list):
        def actor_options(self, i, extra_env=None):
            return {"num_cpus": 0}

    trainers = RayTrainGroup(_dying_args(tmp_path_factory.mktemp("dying"), True), Slots([0]), actor_cls=ray.remote(_EngineDiesInSync))
    manager = ray.remote(_RestartsOnCheck).options(num_cpus=0).remote(8, True)
    yield trainers, manager
    for a in trainers.actors + [manager]:
        ray.kill(a)


def _dying_args(tmp_path, restart):
    from slime.config.arguments import parse_args

    return parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", "3", "--rollout-batch-size", "1",
                       "--n-samples-per-prompt", "8", "--global-batch-size", "8", "--actor-num-gpus-per-node", "1",
                       "--output-dir", os.path.join(str(tmp_path), f"out-{restart}")])


@pytest.mark.parametrize("restart", [True, False])
def test_engine_dying_during_the_weight_sync_is_restarted_and_synced_again(dying_sync, tmp_path, monkeypatch, restart):
    import ray

    import slime.ray.rollout as rollout_module
    from slime import train

    args = _dying_args(tmp_path, restart)
    trainers, manager = dying_sync
    ray.get([a.arm.remote() for a in trainers.actors] + [manager.arm.remote(restart)])
    trainers.args = args  # this case's arguments reach the rank's init, as from a group built for it
    handles = {"actor": trainers}
    monkeypatch.setattr(rollout_module, "create_rollout_manager", lambda args, slots: manager)
    if not restart:  # nothing was restarted: the sync's own error stops the run
        with pytest.raises(Exception, match="unreachable"):
            train._run(args, handles, {"rollout": None})
        return
    records = train._run(args, handles, {"rollout": None})
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 1.0, 0.0]
    assert all(r["weight_sync/engines"] == 1.0 for r in records)  # every version reached the engine
