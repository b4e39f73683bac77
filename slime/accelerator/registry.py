"""Which accelerator this process uses: one registry, detector functions, a per-process cache.

Auto-detection order: NPU (torch_npu imports and a device is present), then CUDA, then CPU.
`SLIME_ACCELERATOR=cpu|cuda|npu` overrides it; an override that cannot be met raises
`AcceleratorUnavailable` with one line naming the cause and the fix.
"""

from __future__ import annotations

import os
import sys
import threading

from slime.accelerator.base import Accelerator, AcceleratorUnavailable

ENV_VAR = "SLIME_ACCELERATOR"
# Comma-separated modules imported before detection; each may call register_accelerator()
# (out-of-tree devices, or a replacement backend such as a test simulator).
PLUGINS_ENV_VAR = "SLIME_ACCELERATOR_PLUGINS"

_CLASSES: dict[str, type[Accelerator]] = {}
_DETECTION_ORDER: list[str] = []
_CURRENT: Accelerator | None = None
_LOCK = threading.Lock()


def register_accelerator(cls: type[Accelerator], *, priority: int | None = None) -> type[Accelerator]:
    """Register a backend. `priority` is its place in auto-detection (lower first); CPU stays last."""
    _CLASSES[cls.name] = cls
    if cls.name in _DETECTION_ORDER:
        _DETECTION_ORDER.remove(cls.name)
    _DETECTION_ORDER.insert(len(_DETECTION_ORDER) if priority is None else priority, cls.name)
    return cls


def accelerator_names() -> list[str]:
    return list(_DETECTION_ORDER)


def accelerator_class(name: str) -> type[Accelerator]:
    if name not in _CLASSES:
        raise AcceleratorUnavailable(
            f"{ENV_VAR}={name!r} is not a known accelerator; valid names: {', '.join(sorted(_CLASSES))}"
        )
    return _CLASSES[name]


def _one_line_excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    # An unmet device request is a configuration error, not a bug: print its one line, not a traceback.
    if issubclass(exc_type, AcceleratorUnavailable) and not os.environ.get("SLIME_DEBUG"):
        print(f"slime: {exc}", file=sys.stderr)
        return
    _previous(exc_type, exc, tb)


def _fail(msg: str) -> AcceleratorUnavailable:
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _one_line_excepthook
    return AcceleratorUnavailable(msg)


def load_plugins() -> None:
    import importlib

    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV_VAR, "").split(","))):
        try:
            importlib.import_module(mod)
        except Exception as e:
            raise _fail(f"{PLUGINS_ENV_VAR}: cannot import accelerator plugin {mod!r} ({type(e).__name__}: {e}); fix or unset it")


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
