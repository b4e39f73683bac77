"""Shared implementation for devices whose torch module mirrors `torch.cuda` (CUDA, Ascend NPU).

Subclasses provide `_module()` (looked up at call time, so tests can substitute a stand-in
that follows the documented API, and so nothing initializes the runtime at import).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from slime.accelerator.base import Accelerator
from slime.accelerator.ipc import COMMON_ALLOWLIST


class DeviceModuleAccelerator(Accelerator):
    ray_noset_env: str  # Ray's RAY_EXPERIMENTAL_NOSET_* variable for this device

    def _module(self) -> Any:  # torch.cuda / torch.npu
        raise NotImplementedError

    # device
    def device_count(self) -> int:
        return int(self._module().device_count())

    def set_device(self, index: int) -> None:
        self._module().set_device(int(index))

    def current_device(self) -> torch.device:
        return torch.device(self.device_type, int(self._module().current_device()))

    # execution
    def synchronize(self) -> None:
        self._module().synchronize()

    @property
    def Stream(self) -> type:
        return self._module().Stream

    @property
    def Event(self) -> type:
        return self._module().Event

    def current_stream(self) -> Any:
        return self._module().current_stream()

    def stream(self, s: Any) -> contextlib.AbstractContextManager:
        return self._module().stream(s)

    # memory
    def memory_stats(self) -> dict[str, int]:
        m = self._module()
        free, total = m.mem_get_info()
        return {
            "allocated": int(m.memory_allocated()),
            "reserved": int(m.memory_reserved()),
            "peak_allocated": int(m.max_memory_allocated()),
            "total": int(total),
            "free": int(free),
        }

    def reset_peak_memory_stats(self) -> None:
        self._module().reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self._module().empty_cache()

    # profiling
    def memory_history_module(self) -> Any | None:
        memory = getattr(self._module(), "memory", None)
        if memory is None or not all(hasattr(memory, f) for f in ("_record_memory_history", "_dump_snapshot")):
            return None
        return memory

    # rng
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self._module().manual_seed_all(seed)

    def get_rng_state(self) -> torch.Tensor:
        return self._module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._module().set_rng_state(state)

    # collectives
    def process_group_backend(self) -> str:
        # CPU tensors (object collectives, barriers) go over gloo; device tensors over the device backend.
        return f"cpu:gloo,{self.device_type}:{self.dist_backend}"

    def _device_env(self) -> dict[str, str]:
        return {}

    def worker_env(self, device_ids: Sequence[int]) -> dict[str, str]:
        ids = sorted({int(i) for i in device_ids})
        if any(i < 0 for i in ids):
            raise ValueError(f"device ids must be >= 0, got {list(device_ids)}")
        env = {
            self.visible_devices_env: ",".join(str(i) for i in ids),
            # We set the visible devices ourselves; stop Ray from overwriting them.
            self.ray_noset_env: "1",
        }
        env.update(self._device_env())
        return env

    # IPC: torch's reductions give a device IPC handle (looked up at call time: torch_npu
    # rebinds reduce_tensor when imported).
    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        if not self.capabilities.ipc:
            raise RuntimeError(
                f"{self.name} device does not support IPC tensor sharing; use the distributed weight-sync path"
            )
        if t.device.type != self.device_type:
            raise ValueError(f"{type(self).__name__}.reduce_tensor got a {t.device} tensor")
        from torch.multiprocessing import reductions

        return reductions.reduce_tensor(t.detach())

    def ipc_rebuild_allowlist(self) -> frozenset[tuple[str, str]]:
        return COMMON_ALLOWLIST | {
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_event"),
        }
