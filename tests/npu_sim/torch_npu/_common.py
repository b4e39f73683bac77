"""Shared pieces of the SIMULATED torch_npu ops: errors, the simulated release, missing derivatives."""

from __future__ import annotations

import inspect
import json
import os

import torch

# Newest simulated Ascend PyTorch (op-plugin) release and its torch_npu wheel.
NEWEST_RELEASE = "26.1.0"
RELEASE_WHEELS = {
    "6.0.0": "2.4.0.post2", "7.0.0": "2.5.1", "7.1.0": "2.6.0", "7.2.0": "2.8.0",
    "7.3.0": "2.9.0", "26.0.0": "2.9.0.post2", "26.1.0": "2.12.0",
}
_release = [NEWEST_RELEASE]

# Simulated SoCs and the device names torch.npu.get_device_name() reports for them.
# 950 names as the SoC tables of torch_npu >= 2.10.0.post4 spell them (tests/data/torch_npu_facts.json).
SOC_DEVICE_NAMES = {"A2": "Ascend910B3", "A3": "Ascend910_9392", "950PR": "Ascend950PR_9579", "950DT": "Ascend950DT_9591"}
DEFAULT_SOC = "A3"
_soc = [DEFAULT_SOC]
# Kernels whose torch_npu API page lists only some SoCs (the docs' "supported products"). On a SoC not
# listed the kernel is missing: 950-class SoCs run aclnn-only, so the call fails at run time.
DOCUMENTED_SOCS = {
    "npu_rms_norm": ("A2", "A3"),
    "npu_rotary_mul": ("A2", "A3"),
    "npu_moe_gating_top_k": ("A2", "A3"),
    "npu_fusion_attention": ("A2", "A3", "950DT"),
}


def soc() -> str:
    return _soc[0]


def is_950() -> bool:
    return _soc[0].startswith("950")


def set_soc(name: str) -> None:
    if name not in SOC_DEVICE_NAMES:
        raise ValueError(f"unknown simulated SoC {name!r}; known: {', '.join(SOC_DEVICE_NAMES)}")
    _soc[0] = name


def require_soc(op: str) -> None:
    """Raise as a kernel without a build for the simulated SoC does (at call time, not at import)."""
    socs = DOCUMENTED_SOCS.get(op)
    if socs is not None and _soc[0] not in socs:
        raise fail(op, f"no kernel for {SOC_DEVICE_NAMES[_soc[0]]} (aclnn-only SoC; the op is documented for "
                       f"{', '.join(socs)} only)")


def release() -> tuple[int, ...]:
    return tuple(int(p) for p in _release[0].split("."))


def at_least(version: str) -> bool:
    return release() >= tuple(int(p) for p in version.split("."))


def set_release(version: str) -> None:
    if version not in RELEASE_WHEELS:
        raise ValueError(f"unknown simulated release {version!r}; known: {', '.join(RELEASE_WHEELS)}")
    _release[0] = version


def fail(op: str, message: str) -> RuntimeError:
    """The error a documented-contract violation raises (real kernels raise RuntimeError too)."""
    return RuntimeError(f"{op}: {message} [simulated torch_npu]")


def check(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise fail(op, message)


def check_contiguous(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise fail(op, f"{name} must be contiguous (non-contiguous tensors are not supported)")


class _NoDerivative(torch.autograd.Function):
    """Marks an output whose op has no registered derivative in the simulated release."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.name = name
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"the derivative for '{ctx.name}' is not implemented [simulated torch_npu]")


def without_derivative(name: str, out: torch.Tensor, *inputs) -> torch.Tensor:
    """`out` (computed without grad) connected to the inputs through a backward that raises."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors or not torch.is_grad_enabled():
        return out
    return _NoDerivative.apply(name, out.detach(), *tensors)


def f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float64)


# --- the wheels' facts (tests/data/torch_npu_facts.json, from scripts/npu-wheel-facts.py) ----------

_FACTS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "data", "torch_npu_facts.json")
_facts_cache: list = []


def facts() -> dict:
    if not _facts_cache:
        with open(_FACTS_PATH, encoding="utf-8") as f:
            _facts_cache.append(json.load(f))
    return _facts_cache[0]


def wheel() -> str:
    """The wheel whose facts the simulator follows: the simulated release's wheel if it was read, else the
    pinned one (releases before the supported range keep their hand-written rules)."""
    w = RELEASE_WHEELS[_release[0]]
    return w if w in facts()["wheels"] else facts()["pinned"]


def _of(entries: list[dict], version: str):
    for e in entries:
        if version in e["versions"]:
            return e["value"]
    return None


def doc(op: str) -> dict:
    """The docstring constraints of `op` in the simulated wheel (empty when the wheel has no docstring)."""
    return _of(facts()["ops"][op]["doc"], wheel()) or {}


def schema(op: str) -> str | None:
    """`op`'s schema in the simulated release's wheel; None when that wheel was not read (older releases)."""
    w = RELEASE_WHEELS[_release[0]]
    if op not in facts()["ops"]:  # recorded in a facts file of its own (npu_fp8_facts.json): its signature binds
        return None
    return _of(facts()["ops"][op]["schema"], w) if w in facts()["wheels"] else None


def schema_args(op: str) -> list[tuple[str, bool]] | None:
    """[(name, keyword_only)] of `op`'s schema in the simulated wheel."""
    text = schema(op)
    if text is None:
        return None
    inner = text[text.index("(") + 1: text.rindex(") ->")]
    out, kwonly, depth, cur = [], False, 0, ""
    for ch in inner + ",":
        depth += ch in "([" 
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            a = cur.strip()
            cur = ""
            if a == "*":
                kwonly = True
            elif a:
                out.append((a.split("=")[0].split()[-1], kwonly))
        else:
            cur += ch
    return out


def torch_ops_call(op: str, fn):
    """`fn` called as torch.ops.npu.<op> is: arguments bound against the wheel's schema, an unknown keyword,
    a keyword-only argument passed positionally or too many arguments raise RuntimeError (torch.ops'
    schema matching), not the TypeError of a Python function."""

    def call(*args, **kwargs):
        params = schema_args(op)
        if params is None:  # a release whose wheel was not read: its Python signature stands for the schema
            try:
                inspect.signature(fn).bind(*args, **kwargs)
            except TypeError as e:
                raise fail(op, str(e)) from None
        else:
            positional = [n for n, kw in params if not kw]
            names = {n for n, _ in params}
            if len(args) > len(positional):
                raise fail(op, f"expected at most {len(positional)} positional argument(s) but got {len(args)}")
            unknown = sorted(set(kwargs) - names)
            if unknown:
                raise fail(op, f"unknown keyword argument(s) {', '.join(unknown)} for schema {schema(op)}")
            twice = sorted(set(kwargs) & set(positional[: len(args)]))
            if twice:
                raise fail(op, f"argument(s) {', '.join(twice)} given positionally and by keyword")
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = op
    call.__wrapped__ = fn
    call.__doc__ = fn.__doc__
    return call


# --- deliberate defects: a finite-but-wrong kernel, for the probe tests -----------------------------

_defects: set[str] = set()
DEFECTS = {
    "npu_lightning_indexer:key_lengths_as_prefix_sums",  # reads actual_seq_lengths_key as cumulative ends
    "npu_sparse_flash_attention:kv_lengths_as_prefix_sums",  # the same for actual_seq_lengths_kv
    "npu_rotary_mul:interleave_as_half",  # rotates interleaved input as if it were "half"
}


def set_defects(names) -> None:
    unknown = set(names) - DEFECTS
    if unknown:
        raise ValueError(f"unknown simulated defect(s) {sorted(unknown)}; known: {sorted(DEFECTS)}")
    _defects.clear()
    _defects.update(names)


def defect(name: str) -> bool:
    return name in _defects
