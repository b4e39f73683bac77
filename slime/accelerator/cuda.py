"""NVIDIA GPU accelerator (torch.cuda, NCCL, CUDA IPC)."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import torch

from slime.accelerator.base import Capabilities
from slime.accelerator.device_module import DeviceModuleAccelerator


class CudaAccelerator(DeviceModuleAccelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    ray_noset_env = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
    op_provider = "slime.accelerator.ops.cuda"
    patch_sets = {"transformers": "slime.accelerator.transformers_patches:register"}  # megatron-core runs on CUDA as written: no megatron set

    def _module(self) -> Any:
        return torch.cuda

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False

    @classmethod
    def unavailable_reason(cls) -> str:
        if not torch.backends.cuda.is_built():
            return (
                f"SLIME_ACCELERATOR=cuda but torch {torch.__version__} is a CPU build; "
                "install a CUDA build of torch or unset SLIME_ACCELERATOR"
            )
        return "SLIME_ACCELERATOR=cuda but no CUDA device is visible; check the driver and CUDA_VISIBLE_DEVICES"

    def probe_capabilities(self) -> Capabilities:
        return Capabilities(bf16=bool(self._module().is_bf16_supported()), ipc=True, graphs=True)

    def _device_env(self) -> dict[str, str]:
        return {
            # Weight-sync buffers are shared across processes; cuMem-based NCCL buffers break that.
            "NCCL_CUMEM_ENABLE": "0",
            # Let NCCL free buffers when the work completes instead of per-stream bookkeeping.
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        }

    def launcher_env(self, core_dump_dir: str | None = None) -> dict[str, str]:
        # Upstream's launcher sets these for every job: one hardware queue, so Megatron's overlapped communication
        # kernels are issued in the order they were enqueued; NVLink SHARP only where the GPUs have NVLink.
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": str(int(has_nvlink()))}
        if core_dump_dir is not None:  # a GPU core dump of the failing kernel, without the bulky memory segments
            env.update({"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1", "CUDA_COREDUMP_SHOW_PROGRESS": "1",
                        "CUDA_COREDUMP_GENERATION_FLAGS": "skip_nonrelocated_elf_images,skip_global_memory,"
                        "skip_shared_memory,skip_local_memory,skip_constbank_memory",
                        "CUDA_COREDUMP_FILE": os.path.join(core_dump_dir, "cuda_coredump_%h.%p.%t")})
        return env

    def deterministic_env(self) -> dict[str, str]:
        # cuBLAS needs a fixed workspace for reproducible GEMMs under torch.use_deterministic_algorithms;
        # NCCL's ring algorithm sums in a fixed order; Transformer Engine refuses its non-deterministic kernels.
        # (The variables upstream's run-qwen2.5-0.5B-reproducibility.sh sets.)
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}

    def set_deterministic(self) -> None:
        super().set_deterministic()
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def has_nvlink() -> bool:
    """This host's GPUs are joined by NVLink (`nvidia-smi topo -m` shows NV# links); False without nvidia-smi."""
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"\bNV\d+\b", topo) is not None
