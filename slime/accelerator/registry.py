"""Which accelerator this process uses: one registry, detector functions, a per-process cache.

Auto-detection order: NPU (torch_npu imports and a device is present), then CUDA, then CPU.
`SLIME_ACCELERATOR=cpu|cuda|npu` overrides it; an override that cannot be met raises
`AcceleratorUnavailable` with one line naming the cause and the fix.
"""

from __future__ import annotations

import os
import threading

from slime.accelerator.base import Accelerator, AcceleratorUnavailable

ENV_VAR = "SLIME_ACCELERATOR"
# Comma-separated modules imported before detection; each may call register_accelerator()
# (out-of-tree devices, or a replacement backend such as a test simulator).
PLUGINS_ENV_VAR = "SLIME_ACCELERATOR_PLUGINS"
# Installed packages add devices through this entry-point group (as vLLM's `vllm.platform_plugins`):
# `[project.entry-points."slime.accelerators"] musa = "slime_musa:MusaAccelerator"`, loaded before detection.
ENTRY_POINT_GROUP = "slime.accelerators"

_CLASSES: dict[str, type[Accelerator]] = {}
_PRIORITIES: dict[str, tuple[int, int]] = {}  # name -> (priority, registration sequence)
_DETECTION_ORDER: list[str] = []
_CURRENT: Accelerator | None = None
_LOCK = threading.Lock()

# Auto-detection probes lower priorities first; equal priorities in registration order.
DEFAULT_PRIORITY = 100  # a plugin registered without a priority: after the built-in devices, before cpu
FALLBACK_PRIORITY = 1000  # cpu: always available, so anything probed after it is never chosen
BUILTIN_PRIORITIES = {"npu": 10, "cuda": 20, "cpu": FALLBACK_PRIORITY}


def register_accelerator(cls: type[Accelerator], *, priority: int | None = None) -> type[Accelerator]:
    """Register a backend (re-registering a name replaces its class). `priority` is its place in
    auto-detection, lower probed first; None keeps the name's previous priority, else the built-in one
    (npu 10, cuda 20, cpu 1000) or DEFAULT_PRIORITY (100). cpu is last unless a priority > 1000 is given."""
    if priority is None:
        priority = _PRIORITIES[cls.name][0] if cls.name in _PRIORITIES else BUILTIN_PRIORITIES.get(cls.name, DEFAULT_PRIORITY)
    _CLASSES[cls.name] = cls
    _PRIORITIES[cls.name] = (int(priority), _PRIORITIES.get(cls.name, (0, len(_PRIORITIES)))[1])
    _DETECTION_ORDER[:] = sorted(_PRIORITIES, key=lambda n: _PRIORITIES[n])
    return cls


def accelerator_names() -> list[str]:
    """Registered names in auto-detection order."""
    return list(_DETECTION_ORDER)


def registered_class(name: str) -> type[Accelerator] | None:
    return _CLASSES.get(name)


def accelerator_class(name: str) -> type[Accelerator]:
    if name not in _CLASSES:
        raise AcceleratorUnavailable(
            f"{ENV_VAR}={name!r} is not a known accelerator; valid names: {', '.join(sorted(_CLASSES))}"
        )
    return _CLASSES[name]


def _fail(msg: str) -> AcceleratorUnavailable:
    # No process-wide excepthook: the command-line entry points print this one line (slime.accelerator.cli).
    return AcceleratorUnavailable(msg)


def _entry_point_class(ep) -> type[Accelerator] | None:
    """The class an entry point names: an Accelerator subclass, or a function returning one (None: this
    package's device is not usable here, e.g. its runtime is missing)."""
    try:
        obj = ep.load()
        cls = obj() if callable(obj) and not isinstance(obj, type) else obj
    except Exception as e:
        raise _fail(f"{ENTRY_POINT_GROUP} entry point {ep.name!r} ({ep.value}) failed to load "
                    f"({type(e).__name__}: {e}); fix or uninstall that package") from e
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise _fail(f"{ENTRY_POINT_GROUP} entry point {ep.name!r} ({ep.value}) gave {cls!r}, not an Accelerator "
                    "subclass; point it at the class (or a function returning it)")
    return cls


def load_entry_points() -> None:
    """Register the accelerators installed packages declare in the `slime.accelerators` group; a name
    already registered keeps its place in detection (re-registering replaces the class)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = _entry_point_class(ep)
        if cls is not None:
            register_accelerator(cls)


def load_plugins() -> None:
    import importlib

    load_entry_points()
    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV_VAR, "").split(","))):
        try:
            importlib.import_module(mod)
        except Exception as e:
            raise _fail(f"{PLUGINS_ENV_VAR}: cannot import accelerator plugin {mod!r} ({type(e).__name__}: {e}); fix or unset it") from e


def detect() -> Accelerator:
    load_plugins()
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested and requested != "auto":
        if requested not in _CLASSES:
            raise _fail(
                f"{ENV_VAR}={requested!r} is not a known accelerator; valid names: {', '.join(sorted(_CLASSES))} (or auto)"
            )
        cls = _CLASSES[requested]
        if not cls.is_available():
            raise _fail(cls.unavailable_reason())
        return cls()
    for name in _DETECTION_ORDER:
        cls = _CLASSES[name]
        if cls.is_available():
            return cls()
    raise _fail("no accelerator available (not even cpu); this is a bug")


def get_accelerator() -> Accelerator:
    """The process's accelerator: detected on first call, then cached."""
    global _CURRENT
    if _CURRENT is None:
        with _LOCK:
            if _CURRENT is None:
                _CURRENT = detect()
    return _CURRENT


def set_accelerator(acc: Accelerator | str | None) -> Accelerator | None:
    """Force the accelerator (an instance or a registered name); None clears the cache (re-detect)."""
    global _CURRENT
    with _LOCK:
        if isinstance(acc, str):
            acc = accelerator_class(acc)()
        _CURRENT = acc
    return acc
