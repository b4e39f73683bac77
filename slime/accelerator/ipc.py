"""Tensor handles for cross-process sharing, and the allow-list unpickler that opens them.

A handle is the pickle of `rebuild_fn(*args)` as produced by torch's multiprocessing
reductions (`reduce_tensor`), serialized with `ForkingPickler` so storages travel as
shared-memory / device-IPC references instead of bytes. Handles come from other
processes (HTTP bodies), so they are opened with an unpickler that resolves only the
globals on an explicit allow-list: tensor-rebuild functions, storage classes, dtypes.
Anything else (os.system, builtins.eval, ...) raises `UnsafeHandleError`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable

import torch

# Globals every tensor handle may reference, whatever the device.
COMMON_ALLOWLIST: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_nested_tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch", "TypedStorage"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("collections", "OrderedDict"),
    }
    | {("torch", str(dt).split(".")[-1]) for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )}
    | {("torch", n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
)


class UnsafeHandleError(pickle.UnpicklingError):
    """A handle referenced a global outside the allow-list."""


class _Reduced:
    """Pickles as `fn(*args)`: lets a (rebuild_fn, args) pair from reduce_tensor travel as one object."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def dumps_reduced(fn: Callable[..., Any], args: tuple) -> bytes:
    """Serialize a reduce_tensor result. ForkingPickler routes nested storages through
    torch's shared-memory reducers (so nothing is copied into the bytes)."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(_Reduced(fn, args)))


class AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            raise UnsafeHandleError(
                f"tensor handle references {module}.{name}, which is not an allowed tensor-rebuild global; "
                "only handles made by Accelerator.share_tensor can be opened"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeHandleError("tensor handles may not contain persistent ids")


def loads_tensor_handle(data: bytes, allowed: frozenset[tuple[str, str]]) -> torch.Tensor:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"tensor handle must be bytes, got {type(data).__name__}")
    obj = AllowListUnpickler(bytes(data), allowed).load()
    if not isinstance(obj, torch.Tensor):
        raise UnsafeHandleError(f"tensor handle decoded to {type(obj).__name__}, expected a Tensor")
    return obj


def serialize_named_tensors(acc: Any, named: list[tuple[str, torch.Tensor]]) -> bytes:
    """SGLang's `serialized_named_tensors` payload (before base64): a pickled list of (name, tensor)
    whose tensors travel as the accelerator's IPC handles. Any unpickler that admits the rebuild
    functions (SGLang's, or `deserialize_named_tensors`) gets the tensors back without a copy."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps([(str(n), _Reduced(*acc.reduce_tensor(t))) for n, t in named]))


def deserialize_named_tensors(data: bytes, allowed: frozenset[tuple[str, str]]) -> list[tuple[str, torch.Tensor]]:
    obj = AllowListUnpickler(bytes(data), allowed).load()
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in obj
    ):
        raise UnsafeHandleError("named-tensor payload must be a list of (str, Tensor) pairs")
    return obj


# --- SGLang's flattened_bucket payload ------------------------------------------------------------------
class _SGLangPickler(pickle._Pickler):
    """ForkingPickler's reducers (tensors and storages travel as handles) in the pure-Python pickler, whose
    `save_global` can write this project's FlattenedTensorMetadata under SGLang's global name without
    importing SGLang. Protocol 4, as SGLang's MultiprocessingSerializer writes on Python < 3.14."""

    def __init__(self, buf: io.BytesIO) -> None:
        from multiprocessing.reduction import ForkingPickler

        super().__init__(buf, protocol=4)
        self.dispatch_table = ForkingPickler._copyreg_dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        from slime.utils.tensor_bucket import SGLANG_METADATA_GLOBAL, FlattenedTensorMetadata

        if obj is not FlattenedTensorMetadata:
            return super().save_global(obj, name)
        module, qualname = SGLANG_METADATA_GLOBAL
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def serialize_flattened_bucket(acc: Any, flat: torch.Tensor, metadata: list) -> bytes:
    """SGLang's flattened_bucket payload (before base64) for one engine TP rank: `{"flattened_tensor": flat,
    "metadata": metadata}` with `flat` travelling as the accelerator's IPC handle (no copy)."""
    buf = io.BytesIO()
    _SGLangPickler(buf).dump({"flattened_tensor": _Reduced(*acc.reduce_tensor(flat)), "metadata": list(metadata)})
    return buf.getvalue()


class _BucketUnpickler(AllowListUnpickler):
    """The allow-list plus SGLang's metadata record, opened as this project's look-alike (no SGLang import)."""

    def find_class(self, module: str, name: str) -> Any:
        from slime.utils.tensor_bucket import SGLANG_METADATA_GLOBAL, FlattenedTensorMetadata

        if (module, name) in (SGLANG_METADATA_GLOBAL, (FlattenedTensorMetadata.__module__, "FlattenedTensorMetadata")):
            return FlattenedTensorMetadata
        return super().find_class(module, name)


def deserialize_flattened_bucket(data: bytes, allowed: frozenset[tuple[str, str]]) -> tuple[torch.Tensor, list]:
    """(flattened_tensor, metadata) of a flattened_bucket payload, opened with the allow-list."""
    obj = _BucketUnpickler(bytes(data), allowed).load()
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise UnsafeHandleError('a flattened_bucket payload must be the dict {"flattened_tensor", "metadata"}')
    if not isinstance(obj["flattened_tensor"], torch.Tensor) or not isinstance(obj["metadata"], list):
        raise UnsafeHandleError("flattened_tensor must be a Tensor and metadata a list")
    return obj["flattened_tensor"], obj["metadata"]
