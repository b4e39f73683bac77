"""Fused-op dispatch: one table of op functions per accelerator.

    ops = get_accelerator().ops
    y = ops.rms_norm(x, w, 1e-6)
    ops.source("attention")   # e.g. "reference", "flash_attn.flash_attn_varlen_func", "torch_npu.npu_fusion_attention"

Every op has a pure-torch reference (slime/accelerator/ops/reference.py, or the op's own module in
REFERENCE_MODULES: the contracts and the source of truth; `reference_op(name)`). A device provider, the module the accelerator class names in `op_provider`, may supply a faster
implementation with the same signature; when it cannot (library missing, version too old) the op
falls back to the reference with one log line. Providers are imported and probed when the table is
built (first `acc.ops` access), never at `import slime`.

`SLIME_OPS=reference` forces the reference for every op; `SLIME_OPS=attention=reference,rms_norm=reference`
per op (`auto` = device implementation when available, the default).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from slime.accelerator.ops import fp8, kda, kpool_indexer, reference

if TYPE_CHECKING:  # pragma: no cover
    from slime.accelerator.base import Accelerator

logger = logging.getLogger(__name__)

ENV_VAR = "SLIME_OPS"
OP_NAMES = (
    "rms_norm",
    "apply_rotary",
    "attention",
    "sparse_attention",
    "lightning_indexer",
    "swiglu",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "grouped_matmul",
    "token_log_probs",
    "kpool_indexer",
    "kda",
    "causal_conv1d",
    "kda_gate",
    "fp8_block_quantize",
)
# Ops whose reference lives in a module of its own (the others' is the function of that name in reference.py).
REFERENCE_MODULES = {"kpool_indexer": kpool_indexer, "kda": kda, "causal_conv1d": kda, "kda_gate": kda,
                     "fp8_block_quantize": fp8}
REFERENCE = "reference"
MODES = (REFERENCE, "auto")


@dataclass(frozen=True)
class DeviceOp:
    """A provider's answer for one op: a function (same signature as the reference) or why not."""

    fn: Callable | None
    source: str  # what runs, e.g. "torch_npu.npu_rms_norm"
    unavailable: str = ""  # fn is None: one-line reason, logged once


_LOGGED: set[str] = set()


def _provider_fn(acc: "Accelerator") -> Callable[[str, "Accelerator"], DeviceOp | None] | None:
    """`resolve(op_name, accelerator) -> DeviceOp | None` of the module `acc` declares as its op provider
    (Accelerator.op_provider; None there: no device implementations, the reference for every op)."""
    provider = type(acc).op_provider
    return None if provider is None else importlib.import_module(provider).resolve


def parse_ops_env(value: str | None) -> dict[str, str]:
    """`SLIME_OPS` -> {op: mode}. "" / "auto" -> {}; "reference" -> every op; "a=reference,b=auto" per op."""
    value = (value or "").strip()
    if not value or value == "auto":
        return {}
    if value == REFERENCE:
        return {name: REFERENCE for name in OP_NAMES}
    modes: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, mode = (s.strip() for s in item.partition("="))
        if not sep or name not in OP_NAMES or mode not in MODES:
            raise ValueError(
                f"{ENV_VAR}={value!r}: bad entry {item!r}; use 'reference' or 'op=reference|auto,...' "
                f"with op in {', '.join(OP_NAMES)}"
            )
        modes[name] = mode
    return modes


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


class OpTable:
    """The op functions of one accelerator, as plain attributes (no per-call lookup)."""

    rms_norm: Callable
    apply_rotary: Callable
    attention: Callable
    sparse_attention: Callable
    lightning_indexer: Callable
    swiglu: Callable
    moe_route: Callable
    moe_permute: Callable
    moe_unpermute: Callable
    grouped_matmul: Callable
    token_log_probs: Callable
    kpool_indexer: Callable
    kda: Callable
    causal_conv1d: Callable
    kda_gate: Callable

    def __init__(self, accelerator_name: str, fns: Mapping[str, Callable], sources: Mapping[str, str]) -> None:
        missing = [n for n in OP_NAMES if n not in fns]
        if missing:
            raise ValueError(f"op table for {accelerator_name!r} lacks {missing}")
        object.__setattr__(self, "accelerator_name", accelerator_name)
        object.__setattr__(self, "_sources", dict(sources))
        for name in OP_NAMES:
            object.__setattr__(self, name, fns[name])

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("OpTable is read-only; register a provider or set SLIME_OPS instead")

    def __getattr__(self, name: str):
        raise AttributeError(f"no op {name!r}; ops: {', '.join(OP_NAMES)}")

    def source(self, name: str) -> str:
        """What implements op `name` ("reference" or the device function)."""
        return self._sources[name]

    def sources(self) -> dict[str, str]:
        return dict(self._sources)

    def __repr__(self) -> str:
        device = {n: s for n, s in self._sources.items() if s != REFERENCE}
        return f"OpTable({self.accelerator_name}, device ops: {device or 'none'})"


def reference_op(name: str) -> Callable:
    """The pure-torch reference of op `name`."""
    return getattr(REFERENCE_MODULES.get(name, reference), name)


def build_op_table(acc: "Accelerator", env: str | None = None) -> OpTable:
    """The op table for `acc`: device implementations where its provider has them, else the reference.
    `env` overrides the SLIME_OPS environment variable (tests)."""
    modes = parse_ops_env(os.environ.get(ENV_VAR) if env is None else env)
    fns: dict[str, Callable] = {n: reference_op(n) for n in OP_NAMES}
    sources = {n: REFERENCE for n in OP_NAMES}
    wanted = [n for n in OP_NAMES if modes.get(n, "auto") != REFERENCE]
    try:
        resolve = _provider_fn(acc) if wanted else None
    except Exception as e:  # a broken provider must not stop training: the reference always works
        log_once(f"ops[{acc.name}]: device op provider failed to load ({type(e).__name__}: {e}); using reference ops")
        resolve = None
    if resolve is None:
        return OpTable(acc.name, fns, sources)
    for name in wanted:
        try:
            choice = resolve(name, acc)
        except Exception as e:
            choice = DeviceOp(None, "", f"probe failed: {type(e).__name__}: {e}")
        if choice is None:
            continue
        if choice.fn is None:
            log_once(f"ops[{acc.name}].{name}: using reference ({choice.unavailable})")
            continue
        fns[name], sources[name] = choice.fn, choice.source
    return OpTable(acc.name, fns, sources)


__all__ = ["ENV_VAR", "OP_NAMES", "DeviceOp", "OpTable", "build_op_table", "parse_ops_env", "reference", "reference_op"]
