"""Upstream slime's accelerator API over this project's `slime.accelerator`; plugins import it as upstream's
`slime.utils.accelerator` (which re-exports this module; it lives here because it names device transports).

Code written for upstream calls `get_accelerator()` (an object with upstream's member names), the
module-level compatibility shims (`device()`, `mem_get_info()`, `process_group_backend()`, ...) and
`register_accelerator(name, factory, is_available, priority, communication_backends)`.

Detection is slime.accelerator's (SLIME_ACCELERATOR, then npu, cuda, cpu): `get_accelerator()` is a view of the
accelerator the trainer and engine use. `register_accelerator` with a `slime.accelerator.Accelerator` subclass as
factory adds it to that one registry (upstream's priority, higher first with cuda at 100, mapped onto it), so the
whole project runs on it. A factory of upstream's kind (an object with upstream's member names) only serves code
that calls this module: it is chosen here when SLIME_ACCELERATOR names it or, available, it outranks upstream's
cuda (priority > 100). MUSA (upstream's built-in `musa` backend) is not supported: asking for it fails in one line.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime.accelerator.upstream_view import AcceleratorView

UPSTREAM_CUDA_PRIORITY = 100  # upstream's built-in cuda backend; musa is 200
_MUSA_REFUSED = ("SLIME_ACCELERATOR=musa: MUSA is not supported by this project (its devices are cpu, cuda, npu); "
                 "register a MUSA backend with slime.utils.accelerator.register_accelerator or unset the variable")


@dataclass(frozen=True)
class _Registration:
    factory: Callable[[], Any]
    is_available: Callable[[], bool]
    priority: int
    communication_backends: tuple[str, ...]


_REGISTRY: dict[str, _Registration] = {}
_SELECTED: list = []  # the chosen backend, once
_LOCK = threading.RLock()


def _project():
    import slime.accelerator as project  # the package registers the built-in devices when imported

    return project


def register_accelerator(name: str, factory: Callable[[], Any], is_available: Callable[[], bool] | None = None,
                         priority: int = 0, communication_backends: tuple[str, ...] = ()) -> None:
    """Add a backend: a slime.accelerator.Accelerator subclass joins the project's registry; any other factory
    serves this module's API (see the module docstring)."""
    normalized = name.strip().lower()
    if not normalized or normalized in {"auto", "none"}:
        raise ValueError("Accelerator name must be a non-empty backend name")
    project = _project()
    if isinstance(factory, type) and issubclass(factory, project.Accelerator):
        from slime.accelerator.registry import BUILTIN_PRIORITIES

        if factory.name != normalized:
            raise ValueError(f"register_accelerator({name!r}, {factory.__name__}): the class's name is "
                             f"{factory.name!r}; register it under that name")
        # upstream: higher first, cuda at 100; the project's registry: lower first, cuda at BUILTIN_PRIORITIES["cuda"]
        project.register_accelerator(factory, priority=BUILTIN_PRIORITIES["cuda"] + UPSTREAM_CUDA_PRIORITY - priority)
        return
    with _LOCK:
        _REGISTRY[normalized] = _Registration(factory, is_available or (lambda: factory().is_available()),
                                              priority, tuple(b.lower() for b in communication_backends))


def _requested() -> str | None:
    value = os.environ.get("SLIME_ACCELERATOR", "").strip().lower()
    return value if value and value != "auto" else None


def _select():
    requested = _requested()
    if requested in _REGISTRY:
        entry = _REGISTRY[requested]
        if not entry.is_available():
            raise RuntimeError(f"Requested accelerator {requested!r} is unavailable: the backend availability "
                               "check returned false")
        return entry.factory()
    if requested == "musa":
        raise RuntimeError(_MUSA_REFUSED)
    if requested is None:
        ranked = sorted(_REGISTRY.items(), key=lambda item: (-item[1].priority, item[0]))
        for _, entry in ranked:
            if entry.priority > UPSTREAM_CUDA_PRIORITY and entry.is_available():
                return entry.factory()
    return AcceleratorView(_project().get_accelerator())


def get_accelerator():
    """The process's backend with upstream's member names (selected once; reset_accelerator() re-selects)."""
    with _LOCK:
        if not _SELECTED:
            _SELECTED.append(_select())
        return _SELECTED[0]


def initialize_accelerator():
    """Upstream returns None on a machine without a device; here the host (cpu) is always one."""
    return get_accelerator()


def set_accelerator(accelerator) -> None:
    project = _project()
    if isinstance(accelerator, project.Accelerator):
        project.set_accelerator(accelerator)
        accelerator = AcceleratorView(accelerator)
    if not callable(getattr(accelerator, "is_available", None)):
        raise TypeError(f"Expected Accelerator, got {type(accelerator).__name__}")
    if not accelerator.is_available():
        raise RuntimeError(f"Cannot install unavailable accelerator backend {accelerator.name!r}")
    with _LOCK:
        _SELECTED[:] = [accelerator]


def reset_accelerator() -> None:
    """Forget this module's choice (tests, process start); slime.accelerator's own cache is left alone."""
    with _LOCK:
        _SELECTED.clear()


def is_musa_available() -> bool:
    return False  # no MUSA backend here


def is_musa_environment() -> bool:
    return (os.environ.get("SLIME_ACCELERATOR", "").lower() == "musa" or "MUSA_VISIBLE_DEVICES" in os.environ
            or bool(os.environ.get("MUSA_PATCH_PATH")))


def is_accelerator_backend(backend: str) -> bool:
    """Whether a torch.distributed backend belongs to a device (not the host's gloo)."""
    project = _project()
    names = {b for entry in _REGISTRY.values() for b in entry.communication_backends}
    names |= {cls.dist_backend for cls in map(project.accelerator_class, project.accelerator_names())
              if cls.dist_backend != "gloo"}
    normalized = backend.lower()
    return any(name in normalized for name in names)


# --- upstream's module-level compatibility shims: each forwards to get_accelerator() --------------------------
def device_type() -> str:
    return get_accelerator().device_type


def accelerator_module() -> Any:
    return get_accelerator().accelerator_module()


def device(index: int | str | torch.device | None = None) -> torch.device:
    return get_accelerator().device(index)


def device_name(index: int | str | torch.device | None = None) -> str:
    return get_accelerator().device_name(index)


def set_device(index: int | str | torch.device) -> None:
    return get_accelerator().set_device(index)


def current_device() -> int | str:
    return get_accelerator().current_device()


def device_count() -> int:
    return get_accelerator().device_count()


def synchronize(device_arg: int | str | torch.device | None = None) -> None:
    return get_accelerator().synchronize(device_arg)


def current_stream(device_arg: int | str | torch.device | None = None) -> Any:
    return get_accelerator().current_stream(device_arg)


def default_stream(device_arg: int | str | torch.device | None = None) -> Any:
    return get_accelerator().default_stream(device_arg)


def stream(stream_arg: Any):
    return get_accelerator().stream(stream_arg)


def new_stream(*args, **kwargs) -> Any:
    return get_accelerator().Stream(*args, **kwargs)


def new_event(*args, **kwargs) -> Any:
    return get_accelerator().Event(*args, **kwargs)


def empty_cache() -> None:
    return get_accelerator().empty_cache()


def ipc_collect() -> None:
    return get_accelerator().ipc_collect()


def set_allocator_expandable_segments() -> bool:
    return get_accelerator().set_allocator_expandable_segments()


def mem_get_info(device_arg: int | str | torch.device | None = None) -> tuple[int, int]:
    return get_accelerator().mem_get_info(device_arg)


def memory_allocated(device_arg: int | str | torch.device | None = None) -> int:
    return get_accelerator().memory_allocated(device_arg)


def memory_reserved(device_arg: int | str | torch.device | None = None) -> int:
    return get_accelerator().memory_reserved(device_arg)


def get_device_properties(device_arg: int | str | torch.device | None = None) -> Any:
    return get_accelerator().get_device_properties(device_arg)


def memory_module() -> Any:
    return get_accelerator().memory_module()


def attach_oom_observer(callback) -> bool:
    return get_accelerator().attach_oom_observer(callback)


def supports(capability: str) -> bool:
    return get_accelerator().supports(capability)


def autocast(*args, **kwargs):
    return get_accelerator().autocast(*args, **kwargs)


def manual_seed(seed: int) -> None:
    return get_accelerator().manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    return get_accelerator().manual_seed_all(seed)


def get_rng_state(device_arg: int | str | torch.device | None = None) -> torch.Tensor:
    return get_accelerator().get_rng_state(device_arg)


def set_rng_state(state: torch.Tensor, device_arg: int | str | torch.device | None = None) -> None:
    return get_accelerator().set_rng_state(state, device_arg)


def initial_seed() -> int:
    return get_accelerator().initial_seed()


def distributed_device_id(index: int | str | torch.device | None = None) -> torch.device | None:
    return get_accelerator().distributed_device_id(index)


def post_import_torch() -> None:
    return get_accelerator().post_import_torch()


def process_group_backend(default: str = "nccl") -> str:
    return get_accelerator().communication_backend(default)


def weight_update_backend(default: str = "nccl") -> str:
    return get_accelerator().weight_update_backend(default)


def visible_devices_env_key() -> str:
    return get_accelerator().visible_devices_env


def resolve_visible_device_id(physical_device_id: int | float | str) -> int:
    return get_accelerator().resolve_visible_device_id(physical_device_id)
