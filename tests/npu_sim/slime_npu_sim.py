"""Accelerator plugin: a SIMULATED Ascend NPU on the host CPU (for tests; not hardware).

    PYTHONPATH=tests/npu_sim SLIME_ACCELERATOR_PLUGINS=slime_npu_sim SLIME_ACCELERATOR=npu python ...

Imported under that top-level name, it makes `import torch_npu` resolve to the documented-contract
simulator in tests/npu_sim/torch_npu and registers `SimulatedAscendAccelerator` as accelerator "npu",
in this process and (through worker_env) in the workers it starts. Everything Ascend-specific runs as
on a real NPU (op table keyed "npu" -> slime/accelerator/ascend/ops.py, patch sets, worker env), except
that tensors live on the CPU, collectives use gloo and IPC uses host shared memory.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Sequence

import torch

from slime.accelerator import AscendAccelerator, CpuAccelerator, register_accelerator
from slime.accelerator.base import Capabilities
from slime.accelerator.ipc import COMMON_ALLOWLIST

SIM_DIR = os.path.dirname(os.path.abspath(__file__))
PLUGIN_NAME = "slime_npu_sim"


def _prepend(value: str, existing: str | None, sep: str) -> str:
    parts = [p for p in (existing or "").split(sep) if p]
    return sep.join([value] + [p for p in parts if p != value])


class SimulatedAscendAccelerator(AscendAccelerator):
    """SIMULATION of an Ascend NPU, not hardware: the Ascend code path (torch_npu kernels through the
    simulator, op table "npu", patches, worker env) with tensors on the host CPU, gloo collectives and
    host shared-memory IPC. Use it to test the NPU glue without an NPU."""

    name = "npu"
    device_type = "cpu"  # where tensors are placed: the simulated device is host memory
    dist_backend = "gloo"
    simulated = True

    @classmethod
    def is_available(cls) -> bool:
        try:
            npu = importlib.import_module("torch_npu")
        except Exception as e:
            cls._import_error = f"import torch_npu failed: {type(e).__name__}: {e}"
            return False
        if not getattr(npu, "SIMULATED", False):
            cls._import_error = "the torch_npu on sys.path is not the simulator (put tests/npu_sim first on PYTHONPATH)"
            return False
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        return f"simulated NPU unavailable: {cls._import_error}; set PYTHONPATH=tests/npu_sim SLIME_ACCELERATOR_PLUGINS={PLUGIN_NAME}"

    def _module(self) -> Any:
        importlib.import_module("torch_npu")
        if not getattr(getattr(torch, "npu", None), "SIMULATED", False):
            import torch_npu as npu

            npu.install_runtime()
        return torch.npu

    def auto_rollout_engine(self) -> str:
        return "embedded"  # SGLang cannot serve from simulated (host) NPU memory

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def device_name(self) -> str:
        return str(self._module().get_device_name())

    @property
    def capabilities(self) -> Capabilities:
        # Host execution: no graph capture; IPC through host shared memory.
        return Capabilities(bf16=True, ipc=True, graphs=False)

    def process_group_backend(self) -> str:
        return "gloo"

    def worker_env(self, device_ids: Sequence[int]) -> dict[str, str]:
        env = super().worker_env(device_ids)
        # Workers must load the simulator too (as a plugin), whatever their start method.
        env["PYTHONPATH"] = _prepend(SIM_DIR, os.environ.get("PYTHONPATH"), os.pathsep)
        env["SLIME_ACCELERATOR_PLUGINS"] = _prepend(PLUGIN_NAME, os.environ.get("SLIME_ACCELERATOR_PLUGINS"), ",")
        env["SLIME_ACCELERATOR"] = "npu"
        return env

    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        return CpuAccelerator.reduce_tensor(self, t)  # host shared memory, as the CPU backend

    def ipc_rebuild_allowlist(self) -> frozenset[tuple[str, str]]:
        return COMMON_ALLOWLIST

    def describe(self) -> str:
        return "npu SIMULATED on CPU (tests/npu_sim; not hardware): " + super().describe()


def register() -> None:
    importlib.import_module("torch_npu")  # the simulator, via PYTHONPATH; installs torch.npu
    register_accelerator(SimulatedAscendAccelerator, priority=0)


if __name__ == PLUGIN_NAME:  # loaded as the plugin (SLIME_ACCELERATOR_PLUGINS), not as npu_sim.slime_npu_sim
    register()
