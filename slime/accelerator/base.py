"""The `Accelerator` interface: everything device-specific that slime needs.

Trainer, rollout engines and models call this interface and never a device module
(`torch.cuda`, `torch_npu`) or a collective backend name directly. Three backends
implement it: `CpuAccelerator`, `CudaAccelerator`, `AscendAccelerator`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from slime.accelerator.ops import OpTable


class AcceleratorUnavailable(RuntimeError):
    """An accelerator was requested that this process cannot use. The message is one line: cause and fix."""


class DeviceConfigError(ValueError):
    """A flag asks for something this device cannot do (`check_and_update_config`). One line: the flag, the fix."""


@dataclass(frozen=True)
class Capabilities:
    """What the device can do, probed once per accelerator instance; code branches on these (and on the
    behaviour predicates of `Accelerator`), never on the accelerator name. Each field has a reader:
    bf16 `check_and_update_config`, graphs `sglang_server_args`, ipc the weight-sync mode and `reduce_tensor`."""

    bf16: bool  # bfloat16 compute (--bf16 is refused without it)
    ipc: bool  # cross-process tensor sharing (colocated weight sync)
    graphs: bool  # CUDA/ACL graph capture (sglang_server_args turns SGLang's off without it)


class NullStream:
    """Stream stand-in for devices without streams (CPU). Same API, no effect."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "NullEvent":
        event = event or NullEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True


class NullEvent:
    """Event stand-in for devices without events (CPU). `elapsed_time` uses the host clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "NullEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._t - self._t) * 1000.0


MEMORY_STAT_KEYS = ("allocated", "reserved", "peak_allocated", "total", "free")


class Accelerator(ABC):
    """One device family. Instances are per process (see `get_accelerator`)."""

    # --- identity -------------------------------------------------------------------------
    name: ClassVar[str]  # "cpu" | "cuda" | "npu"
    device_type: ClassVar[str]  # torch device type
    dist_backend: ClassVar[str]  # "gloo" | "nccl" | "hccl"
    visible_devices_env: ClassVar[str | None]  # env var that restricts visible devices
    ray_resource: ClassVar[str | None]  # Ray resource name for one device, None = CPU bundles

    # --- what the device brings: declared here, looked up by the one accelerator registry --------------------
    # Module with `resolve(op_name, accelerator) -> DeviceOp | None` (slime.accelerator.ops), imported when the
    # op table is built; None: the pure-torch reference for every op.
    op_provider: ClassVar[str | None] = None
    # library -> where its patch set is declared (slime.accelerator.patches), imported on first apply_patches:
    # "package.module" registers its patches when imported; "package.module:function" is called with the
    # accelerator name and registers them. A library not named here gets no patches on this device.
    patch_sets: ClassVar[Mapping[str, str]] = {}

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Detector: can this process use the device? Must not raise."""

    @classmethod
    def unavailable_reason(cls) -> str:
        """One line: why `is_available()` is False, and the fix."""
        return f"accelerator '{cls.name}' is not available in this process"

    @property
    def capabilities(self) -> Capabilities:
        """Probed on first access, then cached for this instance (`probe_capabilities` may query the device
        and import libraries)."""
        caps = self.__dict__.get("_capabilities")
        if caps is None:
            caps = self.probe_capabilities()
            self.__dict__["_capabilities"] = caps
        return caps

    def probe_capabilities(self) -> Capabilities:
        """What this device can do (called once per instance by `capabilities`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement probe_capabilities()")

    # --- behaviour ------------------------------------------------------------------------
    # Predicates in the style of DeepSpeed's accelerator (`is_synchronized_device`): code outside
    # slime/accelerator asks what the device does, never which device it is.
    def is_synchronized_device(self) -> bool:
        """Ops complete before they return: streams and events are no-ops, so there is no compute/comm overlap
        on device streams (CPU)."""
        return False

    def memory_is_host(self) -> bool:
        """Device memory is the host's memory (CPU): offloading to the host frees nothing, and sharing a tensor
        across processes means moving it into shared memory, done once when a buffer is allocated."""
        return False

    def auto_model_dtype(self) -> torch.dtype | str:
        """The dtype `--dtype auto` loads a rollout model in: "auto" keeps the checkpoint's."""
        return "auto"

    def auto_rollout_engine(self) -> str:
        """`--rollout-engine auto` where SGLang is installed: "sglang", or "embedded" where SGLang has no fast
        path on this device."""
        return "sglang"

    def check_and_update_config(self, args: Any) -> None:
        """Device policy on the parsed arguments, on the driver before anything starts (vLLM's platform hook
        of the same name): refuses what the device cannot do (one line naming the flag and the fix) and turns
        off what it lacks. Subclasses extend it (call super())."""
        # (graph capture the device lacks is turned off where SGLang is launched: sglang_server_args)
        caps = self.capabilities
        if args.bf16 and not caps.bf16:
            raise DeviceConfigError(f"--bf16: the {self.name} device has no bfloat16 compute; drop --bf16 (float32)")
        if args.update_weight_mode == "ipc" and not caps.ipc:
            raise DeviceConfigError(f"--update-weight-mode ipc: the {self.name} device cannot share tensors across "
                             "processes; use --update-weight-mode distributed (or auto)")

    def init_worker_process(self) -> None:
        """Per-process set-up in a trainer worker, after `worker_env` took effect (nothing by default)."""
        return None

    def deterministic_env(self) -> dict[str, str]:
        """Environment a bitwise-reproducible run needs on this device (set before its libraries initialise)."""
        return {}

    def set_deterministic(self) -> None:
        """`--deterministic-mode` (Megatron's meaning, as upstream slime sets it at trainer start): only
        deterministic algorithms (torch raises on an op without one), plus the device's own switches.
        Environment variables already set are kept."""
        import os

        for key, value in self.deterministic_env().items():
            os.environ.setdefault(key, value)
        torch.use_deterministic_algorithms(True, warn_only=False)

    # --- device ---------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        """A torch.device for this accelerator (current device when index is None)."""
        if index is None:
            return self.current_device()
        return torch.device(self.device_type, int(index))

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    @abstractmethod
    def current_device(self) -> torch.device: ...

    # --- execution ------------------------------------------------------------------------
    @abstractmethod
    def synchronize(self) -> None: ...

    @property
    @abstractmethod
    def Stream(self) -> type: ...

    @property
    @abstractmethod
    def Event(self) -> type: ...

    @abstractmethod
    def current_stream(self) -> Any: ...

    @abstractmethod
    def stream(self, s: Any) -> contextlib.AbstractContextManager: ...

    # --- memory ---------------------------------------------------------------------------
    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """At least the int byte keys in MEMORY_STAT_KEYS."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None: ...

    @abstractmethod
    def empty_cache(self) -> None: ...

    # --- profiling ------------------------------------------------------------------------
    def memory_history_module(self) -> Any | None:
        """The module whose `_record_memory_history` / `_dump_snapshot` record this device's allocator history;
        None where the device has none (the host)."""
        return None

    # --- rng ------------------------------------------------------------------------------
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed host and device generators."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor: ...

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None: ...

    # --- collectives ----------------------------------------------------------------------
    @abstractmethod
    def process_group_backend(self) -> str:
        """Backend spec for torch.distributed.init_process_group (e.g. "cpu:gloo,cuda:nccl")."""

    @abstractmethod
    def worker_env(self, device_ids: Sequence[int]) -> dict[str, str]:
        """Environment a worker process needs to use exactly `device_ids`."""

    def colocated_env(self) -> dict[str, str]:
        """Extra environment for the processes of a colocated run (trainer ranks and engines sharing devices:
        several communicators per device and host); a value the user set wins. None needed by default."""
        return {}

    def launcher_env(self, core_dump_dir: str | None = None) -> dict[str, str]:
        """Environment upstream's job launcher (slime.utils.external_utils.command_utils.execute_train) puts in a
        job on this device besides the workers' own; core_dump_dir: where device core dumps of a crashed kernel
        go (None: off). Nothing by default, and a device without core dumps refuses them in one line."""
        if core_dump_dir is not None:
            raise DeviceConfigError(f"cuda_core_dump: the {self.name} device writes no device core dumps; "
                                    "leave ExecuteTrainConfig.cuda_core_dump off")
        return {}

    # --- IPC ------------------------------------------------------------------------------
    @abstractmethod
    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        """(rebuild_fn, args) that recreate `t` in another process on this host without a copy."""

    def share_tensor(self, t: torch.Tensor) -> bytes:
        """A handle (bytes) another process on this host opens with `open_tensor`, without a copy."""
        from slime.accelerator.ipc import dumps_reduced

        return dumps_reduced(*self.reduce_tensor(t))

    def open_tensor(self, handle: bytes) -> torch.Tensor:
        """Open a handle from `share_tensor`. Only allow-listed rebuild functions are unpickled."""
        from slime.accelerator.ipc import loads_tensor_handle

        return loads_tensor_handle(handle, self.ipc_rebuild_allowlist())

    @abstractmethod
    def ipc_rebuild_allowlist(self) -> frozenset[tuple[str, str]]:
        """(module, name) globals a tensor handle of this device may reference."""

    def release_ipc_memory(self, pids: Sequence[int]) -> int:
        """Free host-wide IPC memory that processes `pids` shared and can no longer free themselves (they
        were killed, or exited without closing it). Returns how many segments were freed; device IPC
        handles die with their process, so the default frees nothing."""
        return 0

    # --- rollout engine -------------------------------------------------------------------
    def sglang_server_args(self) -> list[str]:
        """Device flags `sglang.launch_server` needs on this accelerator (beyond model/port/tp): without graph
        capture, SGLang's (on by default) is turned off."""
        return [] if self.capabilities.graphs else ["--disable-cuda-graph"]

    # --- patches and ops ------------------------------------------------------------------
    def apply_patches(self, library: str) -> list[str]:
        """Apply this device's documented patch set for `library` (once per process). Returns patch names."""
        from slime.accelerator.patches import apply_patch_set

        return apply_patch_set(self.name, library)

    def revert_patches(self, library: str) -> None:
        from slime.accelerator.patches import revert_patch_set

        revert_patch_set(self.name, library)

    @property
    def ops(self) -> "OpTable":
        """Fused-op dispatch table for this device (see slime.accelerator.ops)."""
        table = self.__dict__.get("_ops")
        if table is None:
            from slime.accelerator.ops import build_op_table

            table = build_op_table(self)
            self.__dict__["_ops"] = table
        return table

    # --- helpers shared by backends -------------------------------------------------------
    def describe(self) -> str:
        caps = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.capabilities).items())
        return f"{self.name} (devices={self.device_count()}, backend={self.process_group_backend()}, {caps})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@contextlib.contextmanager
def null_stream_context(s: Any) -> Iterator[Any]:
    yield s
