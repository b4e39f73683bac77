"""The megatron patches' branches that run only off CPU (a device generator separate from the host's,
device tensors copied to host on a side stream), driven on CPU with STAND-INS: an accelerator that
reports device type "npu" (tensors stay on the host), recording streams, and a tensor subclass that
reports a non-CPU device. Not hardware; these tests check the branch logic, not the device."""

from __future__ import annotations

import contextlib
import logging
import types

import numpy as np
import pytest
import torch


from slime.accelerator import CpuAccelerator, get_accelerator, set_accelerator
from slime.accelerator.megatron_patches import moe, rng
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch


class RecordingStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self, event=None):
        log = self.log
        log.append(("record_event", self.name))
        return types.SimpleNamespace(synchronize=lambda: log.append(("event_synchronize", self.name)))


class StandInNpu(CpuAccelerator):
    """Reports device type "npu" and real streams; tensors, RNG and memory stay the host's."""

    name = "standin-npu"
    device_type = "npu"

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self.main = RecordingStream("main", self.log)
        self.active = self.main

    def current_stream(self):
        return self.active

    @property
    def Stream(self):
        return lambda *a, **k: RecordingStream("side", self.log)

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.active = self.active, s
        try:
            yield
        finally:
            self.active = previous


@pytest.fixture
def standin():
    previous = get_accelerator()
    acc = set_accelerator(StandInNpu())
    try:
        yield acc
    finally:
        set_accelerator(previous)


class DeviceTensor(torch.Tensor):
    """A host tensor that reports a device other than the CPU and records copies and record_stream."""

    log: list = []

    @property
    def device(self):
        return torch.device("meta")

    def to(self, *args, **kwargs):
        acc = get_accelerator()
        self.log.append(("to", str(args[0]), kwargs.get("non_blocking", False), acc.current_stream().name))
        return self.as_subclass(torch.Tensor).clone()

    def record_stream(self, s):
        self.log.append(("record_stream", s.name))


def device_tensor(values, log):
    t = torch.tensor(values).as_subclass(DeviceTensor)
    DeviceTensor.log = log
    return t


@pytest.fixture
def megatron_fork():
    """megatron's own CudaRNGStatesTracker.fork, with the CPU patch set applied (RNG state get/set and
    tracker.add answered by the accelerator)."""
    from megatron.core.tensor_parallel import random

    from slime.backends.megatron.parallel import apply_megatron_patches, revert_megatron_patches

    revert_megatron_patches()
    original = random.CudaRNGStatesTracker.__dict__["fork"]
    apply_megatron_patches()
    return original


def test_rng_fork_off_cpu_runs_megatrons_own_fork(megatron_fork, standin, caplog):
    """Off CPU the fork patch delegates to megatron's fork, which warns when the host generator moves
    inside it: on the stand-in the host generator IS the device one, so the warning proves it ran."""
    from megatron.core.tensor_parallel import random

    calls = []

    @contextlib.contextmanager
    def spy(self, name="model-parallel-rng"):
        calls.append(name)
        with megatron_fork(self, name):
            yield

    tracker = random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    fork = rng.make_tracker_fork(spy)
    caplog.set_level(logging.WARNING)
    outer = torch.get_rng_state()
    with fork(tracker):
        a = torch.rand(3)
    with fork(tracker):
        b = torch.rand(3)
    assert calls == ["model-parallel-rng"] * 2
    assert not torch.equal(a, b)  # the tracked state advanced between forks
    assert torch.equal(torch.get_rng_state(), outer)  # the outer (device) state was restored
    assert any("CPU RNG state changed within GPU RNG context" in r.getMessage() for r in caplog.records)
    tracker2 = random.CudaRNGStatesTracker()
    tracker2.add("model-parallel-rng", 123)
    with fork(tracker2):
        assert torch.equal(torch.rand(3), a)  # same seed, same stream


def test_rng_fork_on_cpu_does_not_call_megatrons_fork():
    from megatron.core.tensor_parallel import random

    calls = []

    @contextlib.contextmanager
    def spy(self, name="model-parallel-rng"):
        calls.append(name)
        yield

    tracker = random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    with rng.make_tracker_fork(spy)(tracker):
        torch.rand(2)
    assert calls == []


def _dispatcher(acc, log, num_local_experts=2):
    return types.SimpleNamespace(
        drop_and_pad=False, cuda_dtoh_point="before_permutation_1", cuda_sync_point="before_ep_alltoall",
        cuda_dtoh_stream=RecordingStream("side", log), num_local_experts=num_local_experts,
        config=types.SimpleNamespace(moe_permute_fusion=False),
        input_splits=device_tensor([1, 2], log), output_splits=device_tensor([2, 1], log),
        output_splits_tp=None, num_out_tokens=device_tensor(3, log),
        num_global_tokens_per_local_expert=device_tensor([[1, 2]], log),
    )


def test_dtoh_copies_device_split_sizes_on_the_side_stream(standin):
    log = standin.log
    d = _dispatcher(standin, log)
    tokens = device_tensor([3, 0], log)
    out = moe.dtoh_and_synchronize(d, "before_permutation_1", tokens)
    assert ("wait_stream", "side", "main") == log[0]  # the side stream waits for the producer first
    copies = [e for e in log if e[0] == "to"]
    assert len(copies) == 5 and all(c[1:] == ("cpu", True, "side") for c in copies)  # async, on the side stream
    # each source stays allocated until the side stream's copy of it is done (as megatron's maybe_move_tensor_to_cpu)
    assert [e for e in log if e[0] == "record_stream"] == [("record_stream", "side")] * 5
    assert isinstance(d.input_splits, np.ndarray) and d.input_splits.tolist() == [1, 2]
    assert isinstance(d.output_splits, np.ndarray) and d.output_splits_tp is None
    assert type(out) is torch.Tensor and out.tolist() == [3, 0]
    assert log[-1] == ("record_event", "side")
    moe.dtoh_and_synchronize(d, "before_ep_alltoall", out)
    assert log[-1] == ("event_synchronize", "side")  # the sync point waits for the copies


def test_dtoh_on_the_side_stream_itself_neither_waits_nor_records(standin):
    log = standin.log
    d = _dispatcher(standin, log, num_local_experts=1)
    standin.active = d.cuda_dtoh_stream
    moe.dtoh_and_synchronize(d, "before_permutation_1", device_tensor([1], log))
    assert not any(e[0] in ("wait_stream", "record_stream") for e in log)
    # tokens, input and output splits, num_out_tokens; not the per-expert counts with one local expert
    assert len([e for e in log if e[0] == "to"]) == 4


def test_device_literal_rewrite_names_the_accelerators_device_type(standin):
    def uses_cuda_literal():
        return torch.zeros(1, device="cuda"), torch.cuda.current_device()

    rebound = with_accelerator_torch(uses_cuda_literal, device_literal=True)
    assert "npu" in rebound.__code__.co_consts and "cuda" not in rebound.__code__.co_consts
    assert "cuda" in uses_cuda_literal.__code__.co_consts  # the original is untouched
