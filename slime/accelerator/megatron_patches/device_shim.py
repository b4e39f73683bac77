"""Re-bind `torch` for ONE named function so its `torch.cuda.<x>` calls go to the accelerator.

For long megatron functions whose only device dependence is a few `torch.cuda.current_device()` /
`torch.cuda.Stream` calls (e.g. the DDP grad-buffer constructor, ~200 lines), copying the body into a
replacement would fork megatron's code. Instead the replacement is the same code object with a globals
mapping in which `torch` is a proxy: every attribute is torch's own except `cuda`, which exposes only
the accelerator-backed members below (anything else raises AttributeError naming the function).
Scope: the listed function only; other code, and `torch.cuda` itself, are untouched.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch


class AcceleratorCudaNamespace:
    """The `torch.cuda` members megatron's patched functions use, answered by the accelerator."""

    def __init__(self, owner: str) -> None:
        self._owner = owner

    @staticmethod
    def _acc():
        from slime.accelerator import get_accelerator

        return get_accelerator()

    def current_device(self) -> torch.device:
        return self._acc().current_device()

    def Stream(self, device: Any = None, priority: int = 0):  # noqa: N802 - mirrors torch.cuda.Stream
        return self._acc().Stream()

    def Event(self, *args: Any, **kwargs: Any):  # noqa: N802
        return self._acc().Event(*args, **kwargs)

    def current_stream(self, device: Any = None):
        return self._acc().current_stream()

    default_stream = current_stream

    def stream(self, s: Any):
        return self._acc().stream(s)

    def synchronize(self, device: Any = None) -> None:
        self._acc().synchronize()

    def empty_cache(self) -> None:
        self._acc().empty_cache()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch.cuda.{name} is used by {self._owner} but has no accelerator mapping; "
            f"add it to slime.accelerator.megatron_patches.device_shim"
        )


class TorchProxy(types.ModuleType):
    """`torch` with `cuda` swapped for the accelerator namespace."""

    def __init__(self, owner: str) -> None:
        super().__init__("torch")
        self.cuda = AcceleratorCudaNamespace(owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _LiveGlobals(dict):
    """Globals for the re-bound function: own entries first, then the defining module's live globals
    (so later patches of other module globals stay visible)."""

    def __init__(self, module_globals: dict, overrides: dict) -> None:
        super().__init__(overrides)
        self["__builtins__"] = module_globals.get("__builtins__", __builtins__)
        self._module_globals = module_globals

    def __missing__(self, key: str) -> Any:
        return self._module_globals[key]


CUDA_TENSOR_TYPES = {
    "torch.cuda.FloatTensor": torch.float32,
    "torch.cuda.HalfTensor": torch.float16,
    "torch.cuda.BFloat16Tensor": torch.bfloat16,
}


def accelerator_tensor_type_names() -> dict[str, str]:
    """CUDA tensor type strings -> this accelerator's (`Tensor.type()` of e.g. a float32 device tensor)."""
    from slime.accelerator import get_accelerator

    dev = get_accelerator().device()
    return {name: torch.empty(0, dtype=dt, device=dev).type() for name, dt in CUDA_TENSOR_TYPES.items()}


def _replace_consts(code: types.CodeType, mapping: dict[str, str]) -> types.CodeType:
    def sub(c):
        if isinstance(c, str):
            return mapping.get(c, c)
        if isinstance(c, tuple):
            return tuple(sub(x) for x in c)
        if isinstance(c, frozenset):
            return frozenset(sub(x) for x in c)
        if isinstance(c, types.CodeType):
            return _replace_consts(c, mapping)
        return c

    return code.replace(co_consts=tuple(sub(c) for c in code.co_consts))


def with_accelerator_torch(func: Callable, tensor_type_names: bool = False, device_literal: bool = False) -> Callable:
    """A copy of `func` (same code, defaults, closure) whose global `torch` is a `TorchProxy`.

    tensor_type_names: also rewrite the exact string constants "torch.cuda.FloatTensor" / "HalfTensor" /
    "BFloat16Tensor" (megatron's optimizers compare `param.type()` against them) to this accelerator's
    type names, resolved when the patch is applied.
    device_literal: also rewrite the exact string constant "cuda" (e.g. `device="cuda"`) to this
    accelerator's device type; only for functions whose every "cuda" constant is a device name."""
    raw = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func
    owner = f"{raw.__module__}.{raw.__qualname__}"
    glb = _LiveGlobals(raw.__globals__, {"torch": TorchProxy(owner)})
    mapping: dict[str, str] = {}
    if tensor_type_names:
        mapping.update(accelerator_tensor_type_names())
    if device_literal:
        from slime.accelerator import get_accelerator

        mapping["cuda"] = get_accelerator().device_type
    code = _replace_consts(raw.__code__, mapping) if mapping else raw.__code__
    new = types.FunctionType(code, glb, raw.__name__, raw.__defaults__, raw.__closure__)
    new.__kwdefaults__ = raw.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = raw.__qualname__, raw.__module__, raw.__doc__
    new.__dict__.update(raw.__dict__)
    new.__wrapped_original__ = raw
    if isinstance(func, staticmethod):
        return staticmethod(new)
    if isinstance(func, classmethod):
        return classmethod(new)
    return new
