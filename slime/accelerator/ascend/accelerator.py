"""Huawei Ascend NPU accelerator (torch_npu, HCCL)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from slime.accelerator.ascend import hccl_buffer, host_checks
from slime.accelerator.ascend.support import soc_of
from slime.accelerator.base import Capabilities
from slime.accelerator.device_module import DeviceModuleAccelerator

GUIDE = "docs/ascend.md"
# sglang.srt.utils.patch_torch.monkey_patch_torch_reductions (SGLang 0.5.x) installs this in place of
# torch_npu.multiprocessing.reductions.rebuild_npu_tensor.
SGLANG_NPU_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified")


def _current_npu_rebuild() -> tuple[str, str] | None:
    """(module, name) of the function torch_npu's reductions currently expose as rebuild_npu_tensor."""
    import sys

    npu_reductions = sys.modules.get("torch_npu.multiprocessing.reductions")
    fn = getattr(npu_reductions, "rebuild_npu_tensor", None)
    if fn is None:
        return None
    return getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "") or ""


def import_torch_npu() -> Any:
    """Import torch_npu (registers torch.npu, the "npu" device and the hccl backend)."""
    return importlib.import_module("torch_npu")


class AscendAccelerator(DeviceModuleAccelerator):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"
    ray_noset_env = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    op_provider = "slime.accelerator.ascend.ops"
    patch_sets = {"megatron": "slime.accelerator.ascend.megatron_patches", "transformers": "slime.accelerator.transformers_patches:register"}

    _import_error: str | None = None
    simulated = False  # tests/npu_sim's accelerator: no driver, CANN or RoCE ports to check
    host_root = "/"  # where the host checks look for /usr/local/Ascend (tests: a fake tree)

    def _module(self) -> Any:
        import_torch_npu()
        return torch.npu

    @classmethod
    def is_available(cls) -> bool:
        # find_spec is truthy even when the import fails (CANN missing), so import for real.
        if importlib.util.find_spec("torch_npu") is None:
            cls._import_error = "torch_npu is not installed"
            return False
        try:
            import_torch_npu()
        except BaseException as e:  # OSError (libhccl.so), ImportError, RuntimeError (version pair)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            cls._import_error = f"import torch_npu failed: {type(e).__name__}: {first}"
            return False
        try:
            ok = bool(torch.npu.is_available()) and int(torch.npu.device_count()) > 0
        except Exception as e:
            cls._import_error = f"torch.npu runtime error: {e}"
            return False
        if not ok:
            cls._import_error = "torch_npu imported but no NPU device is visible"
        return ok

    @classmethod
    def unavailable_reason(cls) -> str:
        cause = cls._import_error or "no NPU available"
        return (
            f"SLIME_ACCELERATOR=npu but {cause}; install CANN and the matching torch_npu, "
            f"`source /usr/local/Ascend/ascend-toolkit/set_env.sh`, see {GUIDE}"
        )

    def device_name(self) -> str:
        try:
            return str(self._module().get_device_name())
        except Exception:
            return ""

    @property
    def capabilities(self) -> Capabilities:
        # Ascend 950DT has no IPC (torch_npu notes); SLIME_NPU_IPC=0/1 overrides the name check. soc_of knows
        # every wheel's 950 names (Ascend950PR_*, Ascend950DT_*; Ascend910_9589 / _9599 up to 2.9.x).
        env = os.environ.get("SLIME_NPU_IPC")
        ipc = env == "1" if env in ("0", "1") else soc_of(self.device_name()) != "950DT"
        m = self._module()
        bf16 = bool(getattr(m, "is_bf16_supported", lambda: True)())
        return Capabilities(bf16=bf16, ipc=ipc, graphs=True)

    def _device_env(self) -> dict[str, str]:
        return {
            # Large MoE all-to-alls and weight broadcasts exceed the 120 s default on first connect.
            "HCCL_CONNECT_TIMEOUT": os.environ.get("HCCL_CONNECT_TIMEOUT", "1800"),
            # The connect timeout covers link set-up only; a collective waiting for a slow peer (the first
            # weight broadcast, a rank saving a checkpoint) is bounded by the execution timeout (CANN
            # default 1836 s; in HCCL's AIV expansion mode A2/A3 cap it at 1091 s).
            "HCCL_EXEC_TIMEOUT": os.environ.get("HCCL_EXEC_TIMEOUT", "3600"),
            # Two-level task queue: the documented recommendation for training throughput.
            "TASK_QUEUE_ENABLE": os.environ.get("TASK_QUEUE_ENABLE", "2"),
            # expandable_segments is the one allocator option every Ascend generation (incl. 950DT) takes.
            "PYTORCH_NPU_ALLOC_CONF": os.environ.get("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True"),
            # Sized for the run by check_and_update_config (hccl_buffer.py), or the user's value; CANN's default
            # (200 MB) where neither is set.
            **({hccl_buffer.ENV: os.environ[hccl_buffer.ENV]} if os.environ.get(hccl_buffer.ENV) else {}),
        }

    def check_and_update_config(self, args: Any) -> None:
        super().check_and_update_config(args)
        # Before Ray: the host's driver / CANN versions and, across nodes, the RoCE links (one line each, exit 2);
        # a simulated NPU has no host stack to check.
        if not self.simulated:
            self.check_host(args.actor_num_nodes > 1, host_checks.visible_device_ids(args.actor_num_gpus_per_node))
        # Workers inherit it through _device_env (worker_env); the value the user exported is kept.
        os.environ.update(hccl_buffer.buffsize_env(args))

    def check_host(self, multi_node: bool, device_ids: list[int]) -> str:
        """This node's driver / CANN versions and, for a multi-node run, its NPUs' RoCE links (host_checks.py):
        a one-line summary, or HostCheckError naming the fix."""
        version = str(getattr(import_torch_npu(), "__version__", ""))
        return host_checks.check_node(version, device_ids, multi_node, host_checks.HostFacts(root=self.host_root))

    def colocated_env(self) -> dict[str, str]:
        # Trainer ranks, engine ranks and the weight-sync group each open HCCL communicators on the same
        # devices and hosts; with HCCL's fixed default ports the second group to bind fails (EJ0003 / EI0019).
        # CANN documents "auto" (the OS picks a free host port) for HCCL_HOST_SOCKET_PORT_RANGE and advises
        # setting it when several processes share one NPU; the device-side listener takes an explicit range
        # (verl's Ascend RL recipes use 61000-61050: one port per process sharing a device, 51 is ample).
        # Not set outside colocated runs: Atlas A2 refuses the host range in networks with MC2 fused ops.
        return {
            "HCCL_HOST_SOCKET_PORT_RANGE": os.environ.get("HCCL_HOST_SOCKET_PORT_RANGE", "auto"),
            "HCCL_NPU_SOCKET_PORT_RANGE": os.environ.get("HCCL_NPU_SOCKET_PORT_RANGE", "61000-61050"),
        }

    def deterministic_env(self) -> dict[str, str]:
        # CANN's switch for deterministic reduction collectives (AllReduce, ReduceScatter, Reduce): the same
        # output for the same input on the same hardware; slower. Documented for Atlas A2 / A3.
        return {"HCCL_DETERMINISTIC": "true"}

    def sglang_server_args(self) -> list[str]:
        # SGLang's NPU build selects the device explicitly and serves attention through its Ascend backend.
        return ["--device", "npu", "--attention-backend", "ascend"]

    def ipc_rebuild_allowlist(self) -> frozenset[tuple[str, str]]:
        allowed = set(super().ipc_rebuild_allowlist())
        allowed.add(("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"))
        # torch_npu rebinds reduce_tensor; admit the rebuild function it emits, wherever it lives.
        from torch.multiprocessing import reductions

        mod = getattr(reductions.reduce_tensor, "__module__", "") or ""
        if mod.startswith("torch_npu"):
            allowed.add((mod, "rebuild_npu_tensor"))
        # SGLang, once loaded, replaces torch_npu's rebuild_npu_tensor with its own wrapper (it remaps the
        # device index to the engine's TP rank); handles pickled in such a process name that wrapper.
        if importlib.util.find_spec("sglang") is not None:
            allowed.add(SGLANG_NPU_REBUILD)
        current = _current_npu_rebuild()
        if current is not None and current[0].split(".")[0] in ("torch_npu", "sglang"):
            allowed.add(current)
        return frozenset(allowed)
