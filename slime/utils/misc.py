"""Small helpers upstream slime's plugins import from here (its names and semantics): `load_function`,
`SingletonMeta`, `decode_int32_meta_array`, `exec_command`, `get_current_node_ip`, `get_free_port`,
`should_run_periodic_action`, `Box`, `group_by`, `chunk_named_params_by_size`."""

from __future__ import annotations

import functools
import importlib
import subprocess
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator


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


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """`bash -c cmd`, echoed first; CalledProcessError when it fails; its stdout (text) with capture_output."""
    print(f"EXEC: {cmd}", flush=True)
    try:
        result = subprocess.run(["bash", "-c", cmd], check=True, capture_output=capture_output,
                                text=capture_output or None)
    except subprocess.CalledProcessError as e:
        if capture_output:
            print(f"{e.stdout=} {e.stderr=}")
        raise
    if not capture_output:
        return None
    print(f"Captured stdout={result.stdout} stderr={result.stderr}")
    return result.stdout


def get_current_node_ip() -> str:
    """This node's address as Ray gives it, without IPv6 brackets (Ray must be importable)."""
    import ray

    return ray.util.get_node_ip_address().strip("[]")


def get_free_port(start_port: int = 10000, consecutive: int = 1) -> int:
    """The first port from `start_port` on where `consecutive` ports in a row are free on 127.0.0.1."""
    from slime.utils.http_utils import is_port_available

    port = start_port
    while not all(is_port_available(port + i) for i in range(consecutive)):
        port += 1
    return port


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None,
                               num_rollout: int | None = None) -> bool:
    """Whether an every-`interval`-rollouts action (eval, save) runs after rollout `rollout_id` (0-based): never
    without an interval; always after the last rollout; after every `interval`-th and at each epoch's end."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    done = rollout_id + 1
    return done % interval == 0 or (num_rollout_per_epoch is not None and done % num_rollout_per_epoch == 0)


class Box:
    """A read-only holder (`.inner`): an object passed by reference where a copy would be made (Ray)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def inner(self) -> Any:
        return self._inner


def group_by(iterable: Iterable, key: Callable | None = None) -> dict:
    """Items by `key(item)` (the item itself without a key), groups in first-seen order; unsorted input is fine."""
    groups: defaultdict = defaultdict(list)
    for item in iterable:
        groups[key(item) if key is not None else item].append(item)
    return dict(groups)


def chunk_named_params_by_size(named_params: Iterable[tuple[str, Any]], chunk_size: int) -> Iterator[list]:
    """(name, tensor) pairs in buckets: a bucket is closed before the pair that would bring it to `chunk_size`
    bytes or more (a pair alone may exceed it)."""
    bucket: list = []
    size = 0
    for name, tensor in named_params:
        if bucket and size + tensor.nbytes >= chunk_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket
