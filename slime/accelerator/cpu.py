"""CPU accelerator: the development and CI device. Runs the same code paths as the real devices."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Sequence

import torch

from slime.accelerator.base import Accelerator, Capabilities, NullEvent, NullStream, null_stream_context
from slime.accelerator.ipc import COMMON_ALLOWLIST


def _rss_high_water() -> int | None:
    """VmHWM of this process in bytes (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource = None
    patch_sets = {"megatron": "slime.accelerator.megatron_patches.cpu", "transformers": "slime.accelerator.transformers_patches:register"}

    def __init__(self) -> None:
        self._peak_rss = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def probe_capabilities(self) -> Capabilities:
        return Capabilities(bf16=True, ipc=True, graphs=False)

    # behaviour: host execution, host memory
    def is_synchronized_device(self) -> bool:
        return True

    def memory_is_host(self) -> bool:
        return True

    def auto_model_dtype(self) -> torch.dtype | str:
        return torch.float32  # bfloat16 matmuls on the host are slower than float32 and round

    def auto_rollout_engine(self) -> str:
        return "embedded"  # SGLang's CPU backend targets x86 AMX servers; the embedded engine runs anywhere

    def check_and_update_config(self, args: Any) -> None:
        super().check_and_update_config(args)
        # Trainer ranks and engines take turns (colocated) or split the cores; Ray would give each 1 thread.
        if "SLIME_CPU_THREADS" not in os.environ:
            cores = args.num_cpus or os.cpu_count() or 1
            workers = args.world_size if args.colocate else args.world_size + args.rollout_num_gpus
            os.environ["SLIME_CPU_THREADS"] = str(max(1, cores // max(1, workers)))

    def init_worker_process(self) -> None:
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))  # Ray starts actors with 1 thread; worker_env sets our share

    # device: one logical CPU device
    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        pass  # every rank shares the host; nothing to select

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    # execution: synchronous; stream/event objects keep the API
    def synchronize(self) -> None:
        pass

    @property
    def Stream(self) -> type:
        return NullStream

    @property
    def Event(self) -> type:
        return NullEvent

    def current_stream(self) -> Any:
        return NullStream()

    def stream(self, s: Any) -> contextlib.AbstractContextManager:
        return null_stream_context(s)

    # memory: torch.cpu has no allocator stats, so use the process's resident set and system memory. The
    # peak is the kernel's resident-set high-water mark (VmHWM), which reset_peak_memory_stats resets through
    # /proc/self/clear_refs (Linux); where either is unavailable, the highest RSS seen by memory_stats calls.
    def memory_stats(self) -> dict[str, int]:
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        self._peak_rss = max(self._peak_rss, rss, _rss_high_water() or 0)
        vm = psutil.virtual_memory()
        return {
            "allocated": rss,
            "reserved": rss,
            "peak_allocated": self._peak_rss,
            "total": int(vm.total),
            "free": int(vm.available),
        }

    def reset_peak_memory_stats(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self._peak_rss = 0
        self.memory_stats()

    def empty_cache(self) -> None:
        pass

    # rng
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    # collectives
    def process_group_backend(self) -> str:
        return "gloo"

    def worker_env(self, device_ids: Sequence[int]) -> dict[str, str]:
        # Ray sets OMP_NUM_THREADS=1 for actors; a trainer or engine actor should use its CPU share.
        threads = os.environ.get("SLIME_CPU_THREADS")
        return {"OMP_NUM_THREADS": threads} if threads else {}

    # IPC: POSIX shared memory through torch's "file_system" strategy. The default
    # "file_descriptor" strategy passes fds over a socket guarded by the multiprocessing
    # authkey, which differs between Ray workers; file names work across any two processes.
    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        if t.device.type != "cpu":
            raise ValueError(f"CpuAccelerator.reduce_tensor got a {t.device} tensor; move it to cpu first")
        import torch.multiprocessing as mp
        from torch.multiprocessing import reductions

        if mp.get_sharing_strategy() != "file_system":
            mp.set_sharing_strategy("file_system")
        t = t.detach()
        if not t.is_shared():
            t.share_memory_()
        return reductions.reduce_tensor(t)

    def release_ipc_memory(self, pids: Sequence[int]) -> int:
        # torch's file_system strategy names its segments /dev/shm/torch_<creating pid>_<random>_<n>; a
        # process killed by Ray (or exiting before torch's shm manager sweeps) leaves them behind. An engine
        # that still maps one keeps its mapping; only the name goes.
        import glob

        removed = 0
        for pid in pids:
            for path in glob.glob(f"/dev/shm/torch_{int(pid)}_*"):
                try:
                    os.remove(path)
                    removed += 1
                except OSError:
                    pass
        return removed

    def sglang_server_args(self) -> list[str]:
        return ["--device", "cpu", *super().sglang_server_args()]

    def ipc_rebuild_allowlist(self) -> frozenset[tuple[str, str]]:
        return COMMON_ALLOWLIST
