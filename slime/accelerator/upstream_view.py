"""Upstream slime's `Accelerator` member names over one of this project's accelerators (slime.accelerator).

Memory figures come from the project's `memory_stats()` (the device allocator's, or the process's resident
memory on the host); streams, events and seeds from its own methods; what only a device runtime has
(device names and properties, IPC collection, the OOM observer) from the torch module of its device type.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch



class AcceleratorView:
    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator  # the slime.accelerator.Accelerator seen through upstream's names
        self.name = accelerator.name
        self.device_type = accelerator.device_type
        self.communication_backend_name = accelerator.dist_backend

    def __repr__(self) -> str:
        return f"AcceleratorView({self.accelerator!r})"

    def _module(self) -> Any:
        return getattr(torch, self.device_type, None)

    def is_available(self) -> bool:
        return type(self.accelerator).is_available()

    def accelerator_module(self) -> Any:
        """The torch namespace of the device (None for the host, as upstream's)."""
        return None if self.accelerator.memory_is_host() else self._module()

    # --- devices ---------------------------------------------------------------------------
    def device(self, index: int | str | torch.device | None = None) -> torch.device:
        if isinstance(index, torch.device):
            return index
        if isinstance(index, str):
            return torch.device(index)
        return self.accelerator.device(index)

    def device_name(self, index: int | str | torch.device | None = None) -> str:
        get_name = getattr(self.accelerator_module(), "get_device_name", None)
        return str(get_name(self.device(index))) if get_name else self.name

    def set_device(self, index: int | str | torch.device) -> None:
        self.accelerator.set_device(self.device(index).index or 0)

    def current_device(self) -> int | str:
        current = self.accelerator.current_device()
        return current.index if current.index is not None else current.type

    def device_count(self) -> int:
        return int(self.accelerator.device_count())

    def distributed_device_id(self, index: int | str | torch.device | None = None) -> torch.device | None:
        return None if self.accelerator.memory_is_host() else self.device(index)

    @property
    def visible_devices_env(self) -> str | None:
        return self.accelerator.visible_devices_env

    def resolve_visible_device_id(self, physical_device_id: int | float | str) -> int:
        """A physical id to the local id under the visibility variable (upstream's rule: a listed physical id
        maps to its place, a number below the list's length is already local)."""
        raw = str(physical_device_id).strip()
        visible = os.environ.get(self.visible_devices_env) if self.visible_devices_env else None
        if not visible:
            return int(float(raw))
        ids = [item.strip() for item in visible.split(",") if item.strip()]
        if raw in ids:
            return ids.index(raw)
        try:
            value = int(float(raw))
        except ValueError:
            value = None
        if value is not None and str(value) in ids:
            return ids.index(str(value))
        if value is not None and 0 <= value < len(ids):
            return value
        raise RuntimeError(f"Device id {raw} is not valid under {self.visible_devices_env}={visible}. "
                           f"Expected one of {ids} (physical) or 0..{len(ids) - 1} (local).")

    # --- execution -------------------------------------------------------------------------
    def synchronize(self, device: int | str | torch.device | None = None) -> None:
        self.accelerator.synchronize()

    def current_stream(self, device: int | str | torch.device | None = None) -> Any:
        return self.accelerator.current_stream()

    def default_stream(self, device: int | str | torch.device | None = None) -> Any:
        default = getattr(self.accelerator_module(), "default_stream", None)
        return default() if default else self.accelerator.current_stream()

    def stream(self, stream: Any):
        return self.accelerator.stream(stream)

    @property
    def Stream(self) -> Any:
        return self.accelerator.Stream

    @property
    def Event(self) -> Any:
        return self.accelerator.Event

    def autocast(self, *args, **kwargs):
        return torch.autocast(self.device_type, *args, **kwargs)

    # --- memory ----------------------------------------------------------------------------
    def empty_cache(self) -> None:
        self.accelerator.empty_cache()

    def ipc_collect(self) -> None:
        collect = getattr(self.accelerator_module(), "ipc_collect", None)
        if collect:
            collect()

    def set_allocator_expandable_segments(self) -> bool:
        """Not done through this API: the project sets its allocator options per device at start."""
        return False

    def mem_get_info(self, device: int | str | torch.device | None = None) -> tuple[int, int]:
        stats = self.accelerator.memory_stats()
        return int(stats["free"]), int(stats["total"])

    def memory_allocated(self, device: int | str | torch.device | None = None) -> int:
        return int(self.accelerator.memory_stats()["allocated"])

    def memory_reserved(self, device: int | str | torch.device | None = None) -> int:
        return int(self.accelerator.memory_stats()["reserved"])

    def get_device_properties(self, device: int | str | torch.device | None = None) -> Any:
        props = getattr(self.accelerator_module(), "get_device_properties", None)
        if props is None:
            raise NotImplementedError(f"Accelerator {self.name!r} has no device properties")
        return props(self.device(device))

    def memory_module(self) -> Any:
        return self.accelerator.memory_history_module()

    def attach_oom_observer(self, callback) -> bool:
        return False  # the project records OOMs through its own memory snapshots (--record-memory-history)

    def supports(self, capability: str) -> bool:
        """Upstream's capability names this project can answer: bf16 (and ipc, graphs, its own)."""
        with contextlib.suppress(AttributeError):
            return bool(getattr(self.accelerator.capabilities, capability))
        return False

    # --- seeds -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self.accelerator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.accelerator.manual_seed(seed)

    def get_rng_state(self, device: int | str | torch.device | None = None) -> torch.Tensor:
        return self.accelerator.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
        self.accelerator.set_rng_state(state)

    def initial_seed(self) -> int:
        initial = getattr(self.accelerator_module(), "initial_seed", None)
        return int(initial() if initial else torch.initial_seed())

    # --- collectives -----------------------------------------------------------------------
    def post_import_torch(self) -> None:
        return None  # the project applies its device patches where each library is imported

    def communication_backend(self, default: str = "nccl") -> str:
        """Upstream's rule: the logical default "nccl" maps to this device's transport, anything else is kept."""
        return self.communication_backend_name if default == "nccl" else default

    def weight_update_backend(self, default: str = "nccl") -> str:
        return self.communication_backend(default)
