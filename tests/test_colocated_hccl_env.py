"""Colocated runs on Ascend: every trainer / engine process gets HCCL port ranges that do not collide
(slime.accelerator.ascend AscendAccelerator.colocated_env, applied by DeviceSlots.actor_options when the role
shares its devices); a value the user exported wins; split placements and other accelerators get nothing."""

from __future__ import annotations

import pytest

from slime.ray.placement_group import ROLLOUT_SHARE_COLOCATED, TRAIN_SHARE_COLOCATED, DeviceSlots

npu_sim = pytest.importorskip("npu_sim")
PORT_VARS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")


def _env(share: float) -> dict[str, str]:
    slots = DeviceSlots(pg=None, bundle_indices=[0], device_ids=[0], node_ips=["127.0.0.1"], cpus_per_bundle=1.0,
                        share=share)
    return slots.actor_options(0)["runtime_env"]["env_vars"]


@pytest.fixture
def npu(monkeypatch):
    from slime.accelerator import get_accelerator, set_accelerator

    for name in PORT_VARS:
        monkeypatch.delenv(name, raising=False)
    previous = get_accelerator()
    with npu_sim.activate(reuse_probes=True) as acc:
        set_accelerator(acc)
        try:
            yield acc
        finally:
            set_accelerator(previous)


@pytest.mark.parametrize("share", [TRAIN_SHARE_COLOCATED, ROLLOUT_SHARE_COLOCATED])
def test_colocated_roles_get_the_port_ranges(npu, share):
    env = _env(share)
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto"  # CANN: the OS picks a free host port
    assert env["HCCL_NPU_SOCKET_PORT_RANGE"] == "61000-61050"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0"  # the device pinning is unchanged


def test_user_values_win_and_split_placement_gets_none(npu, monkeypatch):
    monkeypatch.setenv("HCCL_HOST_SOCKET_PORT_RANGE", "60000-60050")
    monkeypatch.setenv("HCCL_NPU_SOCKET_PORT_RANGE", "62000-62010")
    env = _env(TRAIN_SHARE_COLOCATED)
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "60000-60050" and env["HCCL_NPU_SOCKET_PORT_RANGE"] == "62000-62010"
    monkeypatch.delenv("HCCL_HOST_SOCKET_PORT_RANGE")
    monkeypatch.delenv("HCCL_NPU_SOCKET_PORT_RANGE")
    assert not set(PORT_VARS) & set(_env(1.0))


def test_other_accelerators_add_nothing():
    from slime.accelerator import CpuAccelerator

    assert CpuAccelerator().colocated_env() == {}
