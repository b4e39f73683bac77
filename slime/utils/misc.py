"""Small helpers upstream slime's plugins import from here: `load_function`, `SingletonMeta`,
`decode_int32_meta_array`."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable


class FunctionPathError(ImportError):
    """A `--custom-*-path` that names no importable function. One line: the path and the fix."""


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """The object named by `package.module.attr` (or `package.module:attr`), e.g. a hook given on the command line."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise FunctionPathError(f"{path!r} must look like package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise FunctionPathError(f"cannot import {module_name!r} for {path!r} ({e}); is it on PYTHONPATH?") from e
    if not hasattr(module, attr):
        raise FunctionPathError(f"{module_name} has no attribute {attr!r} (from {path!r})")
    return getattr(module, attr)


def decode_int32_meta_array(meta_info: dict, keys: str | tuple[str, ...]) -> Any:
    """An int32 array SGLang puts in `meta_info` (e.g. "routed_experts": base64 of the int32 bytes; a list or a tensor
    are taken too) as a flat int32 CPU tensor; None when no key of `keys` is there (or its value is None)."""
    import base64

    import torch

    for key in (keys,) if isinstance(keys, str) else keys:
        if meta_info.get(key) is not None:
            value = meta_info[key]
            break
    else:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % 4:
            raise ValueError(f"meta_info[{key!r}] holds {len(value)} bytes, not a whole number of int32 values")
        return torch.frombuffer(bytearray(value), dtype=torch.int32) if value else torch.zeros(0, dtype=torch.int32)
    return torch.as_tensor(value).to(device="cpu", dtype=torch.int32).reshape(-1)


class SingletonMeta(type):
    """One instance per class (GenerateState); `clear_instances()` forgets it (a new run, a test)."""

    _instances: dict = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances.pop(cls, None)
