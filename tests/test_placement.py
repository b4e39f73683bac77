"""Ray placement of trainer ranks and rollout engines, with a stand-in accelerator whose Ray resource is
"GPU": bundle shapes, the options each actor asks for, and (on a local Ray with declared GPUs) that a
multi-device engine actor really holds every device of its bundle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.accelerator import get_accelerator, set_accelerator
from slime.accelerator.cpu import CpuAccelerator
from slime.ray.placement_group import (
    ROLLOUT_SHARE_COLOCATED,
    DeviceSlots,
    _bundle,
    bundle_devices,
    create_placement_groups,
)

ray = pytest.importorskip("ray")


class GpuStandIn(CpuAccelerator):
    """CPU compute, but placed like a GPU accelerator; its worker env names the devices it is given."""

    name = "gpu-standin"
    ray_resource = "GPU"

    def worker_env(self, device_ids):
        return {"STANDIN_VISIBLE_DEVICES": ",".join(str(i) for i in device_ids)}


@pytest.fixture
def gpu_standin():
    previous = get_accelerator()
    set_accelerator(GpuStandIn())
    try:
        yield
    finally:
        set_accelerator(previous)


def _args(nodes=1, per_node=4, rollout=4, per_engine=2, colocate=False):
    return SimpleNamespace(actor_num_nodes=nodes, actor_num_gpus_per_node=per_node, rollout_num_gpus=rollout,
                           rollout_num_gpus_per_engine=per_engine, colocate=colocate, debug_rollout_only=False,
                           num_gpus_per_node=per_node)


def _slots(n_bundles, per_bundle, share, nodes, device_ids):
    return DeviceSlots(pg=None, bundle_indices=list(range(10, 10 + n_bundles)), device_ids=device_ids,
                       node_ips=nodes, cpus_per_bundle=1.0, share=share, devices_per_bundle=per_bundle)


def test_bundle_shapes(gpu_standin):
    assert bundle_devices(_args(per_node=4, rollout=8, per_engine=4)) == ([1] * 4 + [4, 4], 4)
    assert bundle_devices(_args(nodes=2, per_node=4, rollout=8, per_engine=4, colocate=True)) == ([1] * 8, 8)
    assert _bundle(1.0, 4) == {"GPU": 4, "CPU": 1.0}
    set_accelerator("cpu")
    assert _bundle(0.5, 4) == {"CPU": 0.5}  # CPU: a bundle is a worker slot


def test_split_engine_reserves_its_whole_bundle(gpu_standin):
    slots = _slots(2, 4, 1.0, ["n0", "n1"], [0, 1, 2, 3, 4, 5, 6, 7])
    opts, ids = slots.engine_options(1, 4)
    assert ids == [4, 5, 6, 7] and opts["num_gpus"] == 4 and isinstance(opts["num_gpus"], int)
    assert opts["scheduling_strategy"].placement_group_bundle_index == 11
    assert opts["runtime_env"]["env_vars"] == {"STANDIN_VISIBLE_DEVICES": "4,5,6,7"}
    with pytest.raises(ValueError, match="needs bundles 2..2 but only 2"):
        slots.engine_options(2, 4)
    with pytest.raises(ValueError, match="bundles hold 4 devices, engines need 2"):
        slots.engine_options(0, 2)


def test_colocated_engine_spans_trainer_bundles_of_one_node(gpu_standin):
    slots = _slots(8, 1, ROLLOUT_SHARE_COLOCATED, ["n0"] * 4 + ["n1"] * 4, [0, 1, 2, 3, 0, 1, 2, 3])
    opts, ids = slots.engine_options(1, 2)
    assert ids == [2, 3] and opts["num_gpus"] == pytest.approx(ROLLOUT_SHARE_COLOCATED)
    assert opts["scheduling_strategy"].placement_group_bundle_index == 12  # its first device's bundle
    assert opts["runtime_env"]["env_vars"] == {"STANDIN_VISIBLE_DEVICES": "2,3"}
    assert slots.engine_options(3, 2)[1] == [2, 3]  # second node, its devices 2 and 3
    with pytest.raises(ValueError, match=r"span nodes \['n0', 'n1'\].*divide the devices per node"):
        _slots(6, 1, 0.2, ["n0"] * 3 + ["n1"] * 3, [0, 1, 2, 0, 1, 2]).engine_options(1, 2)
    trainer = _slots(8, 1, 0.4, ["n0"] * 8, list(range(8)))
    assert trainer.actor_options(5)["num_gpus"] == pytest.approx(0.4)
    assert trainer.actor_options(5)["runtime_env"]["env_vars"] == {"STANDIN_VISIBLE_DEVICES": "5"}


@ray.remote
class _Probe:
    def gpus(self):
        return sorted(int(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"])


def test_engine_actor_holds_all_its_devices_on_ray(gpu_standin):
    """Local Ray with 4 declared GPUs: 2 trainer devices + one 2-device engine (split). The engine actor
    gets both devices of its bundle, and nothing else fits on that bundle."""
    if ray.is_initialized():
        pytest.skip("needs its own Ray session with declared GPUs")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # a cluster of its own: a bare ray.init() joins one another process on the machine recorded
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        slots = create_placement_groups(_args(per_node=2, rollout=2, per_engine=2), cpus_per_bundle=0.25)
        rollout = slots["rollout"]
        assert len(slots["actor"]) == 2 and len(rollout) == 1 and rollout.devices_per_bundle == 2
        opts, ids = rollout.engine_options(0, 2)
        assert len(ids) == 2 and not set(ids) & set(slots["actor"].device_ids)
        actor = _Probe.options(**opts).remote()
        assert ray.get(actor.gpus.remote(), timeout=60) == sorted(ids)
        # The bundle is fully booked: another device request on it cannot be placed.
        extra = _Probe.options(**{**opts, "num_gpus": 1, "num_cpus": 0}).remote()
        ready, _ = ray.wait([extra.gpus.remote()], timeout=2)
        assert not ready
        ray.kill(extra)
        ray.kill(actor)
    finally:
        ray.shutdown()


@pytest.mark.parametrize("address, joins", [("", False), ("local", False), ("auto", True), ("10.0.0.1:6379", True)])
def test_init_ray_starts_a_sized_local_cluster_unless_joining_one(monkeypatch, address, joins):
    """RAY_ADDRESS=local starts a new cluster like an unset RAY_ADDRESS does (--num-cpus applies; the run stops
    it); any other address joins a running cluster, whose resources are its own."""
    import ray

    from slime.ray import placement_group

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RAY_ADDRESS", address)
    placement_group.init_ray(num_cpus=3)
    assert placement_group.joins_ray_cluster() is joins
    assert len(calls) == 1 and ("num_cpus" not in calls[0] if joins else calls[0]["num_cpus"] == 3), calls
    assert joins or calls[0]["address"] == "local", calls  # never the cluster Ray's temp dir records


@pytest.mark.slow
def test_init_ray_starts_its_own_cluster_when_ray_records_another():
    """Without RAY_ADDRESS a run starts its own cluster even when Ray's temp dir records one (a `ray start` head
    or another test's cluster on this machine): a bare ray.init() would join the recorded address and then
    refuse --num-cpus. The recorded address here is a dead port, so joining it cannot succeed."""
    import tempfile

    # A short temp dir: Ray's socket paths under it must stay within AF_UNIX's 107 bytes (pytest's tmp_path does not).
    with tempfile.TemporaryDirectory(prefix="ray") as short:
        _run_init_ray_beside_a_recorded_cluster(Path(short))


def _run_init_ray_beside_a_recorded_cluster(ray_tmp: Path) -> None:
    (ray_tmp / "ray").mkdir(parents=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmp), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    code = ("import ray\nfrom slime.ray.placement_group import init_ray\ninit_ray(num_cpus=1)\n"
            "print(ray.cluster_resources()['CPU'])\nray.shutdown()\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "1.0", r.stderr[-3000:]
