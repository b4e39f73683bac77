"""Behaviour predicates, probed-once capabilities and the check_and_update_config hook of the accelerators."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest
import torch

from slime.accelerator import Capabilities, CpuAccelerator, CudaAccelerator, DeviceConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(**over) -> argparse.Namespace:
    base = dict(bf16=False, sglang_disable_cuda_graph=False, update_weight_mode="auto", num_cpus=None,
                colocate=True, world_size=2, rollout_num_gpus=2)
    base.update(over)
    return argparse.Namespace(**base)


class _Counting(CpuAccelerator):
    probes = 0

    def probe_capabilities(self) -> Capabilities:
        type(self).probes += 1
        return Capabilities(bf16=False, ipc=False, graphs=False)


def test_capabilities_are_probed_once_per_instance():
    _Counting.probes = 0
    acc = _Counting()
    assert [acc.capabilities.ipc for _ in range(5)] == [False] * 5
    assert acc.capabilities is acc.capabilities and _Counting.probes == 1
    _Counting()  # a new instance probes on its own first access, not at construction
    assert _Counting.probes == 1


def test_cuda_capabilities_are_cached(monkeypatch):
    calls = []

    class Mod:
        def is_bf16_supported(self):
            calls.append(1)
            return True

    monkeypatch.setattr(CudaAccelerator, "_module", lambda self: Mod())
    acc = CudaAccelerator()
    assert acc.capabilities == Capabilities(bf16=True, ipc=True, graphs=True) and acc.capabilities.graphs
    assert len(calls) == 1


def test_every_capability_field_is_read_outside_tests():
    code = []
    for root in ("slime", "slime_plugins"):
        for dirpath, _, files in os.walk(os.path.join(REPO, root)):
            code += [open(os.path.join(dirpath, f), encoding="utf-8").read() for f in files if f.endswith(".py")]
    text = "\n".join(code)
    unread = [f.name for f in dataclasses.fields(Capabilities)
              if not re.search(rf"\b(?:capabilities|caps)\.{f.name}\b", text)]
    assert not unread, f"Capabilities fields nothing reads (wire or delete them): {unread}"


def test_cpu_predicates():
    acc = CpuAccelerator()
    assert acc.is_synchronized_device() and acc.memory_is_host()
    assert acc.auto_model_dtype() is torch.float32 and acc.auto_rollout_engine() == "embedded"


def test_device_predicates_default_to_an_asynchronous_device_with_its_own_memory(monkeypatch):
    monkeypatch.setattr(CudaAccelerator, "_module", lambda self: None)
    acc = CudaAccelerator()
    assert not acc.is_synchronized_device() and not acc.memory_is_host()
    assert acc.auto_model_dtype() == "auto" and acc.auto_rollout_engine() == "sglang"


@pytest.mark.parametrize("colocate, cores, expect", [(True, 8, "4"), (False, 8, "2"), (False, 3, "1")])
def test_cpu_config_hook_splits_the_cores(monkeypatch, colocate, cores, expect):
    monkeypatch.delenv("SLIME_CPU_THREADS", raising=False)
    args = _args(colocate=colocate, num_cpus=cores)
    CpuAccelerator().check_and_update_config(args)
    assert os.environ["SLIME_CPU_THREADS"] == expect


def test_cpu_config_hook_keeps_the_users_thread_count(monkeypatch):
    monkeypatch.setenv("SLIME_CPU_THREADS", "7")
    CpuAccelerator().check_and_update_config(_args(num_cpus=64))
    assert os.environ["SLIME_CPU_THREADS"] == "7"


def test_config_hook_refuses_what_the_device_cannot_do(monkeypatch):
    monkeypatch.setenv("SLIME_CPU_THREADS", "1")
    acc = _Counting()
    with pytest.raises(DeviceConfigError, match="--bf16.*drop --bf16"):
        acc.check_and_update_config(_args(bf16=True))
    with pytest.raises(DeviceConfigError, match="--update-weight-mode ipc.*distributed"):
        acc.check_and_update_config(_args(update_weight_mode="ipc"))
    args = _args(update_weight_mode="distributed")
    acc.check_and_update_config(args)  # what it can do passes
    assert args.update_weight_mode == "distributed"


def test_config_hook_passes_what_the_device_can_do(monkeypatch):
    class Mod:
        def is_bf16_supported(self):
            return True

    monkeypatch.setattr(CudaAccelerator, "_module", lambda self: Mod())
    args = _args(bf16=True, update_weight_mode="ipc")
    before = dict(vars(args))
    CudaAccelerator().check_and_update_config(args)
    assert vars(args) == before


def test_sglang_graph_capture_follows_the_graphs_capability(monkeypatch):
    class Mod:
        def is_bf16_supported(self):
            return True

    monkeypatch.setattr(CudaAccelerator, "_module", lambda self: Mod())
    assert CudaAccelerator().sglang_server_args() == []  # graphs: SGLang captures them as it does by default
    assert CpuAccelerator().sglang_server_args() == ["--device", "cpu", "--disable-cuda-graph"]
    assert _Counting().sglang_server_args()[-1] == "--disable-cuda-graph"
