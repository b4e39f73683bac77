"""Ascend implementations of the slime ops, on torch_npu fused kernels (provider for accelerator "npu").

Each function has the reference signature (slime/accelerator/ops/reference.py) and calls the reference
itself for inputs its kernel does not take (documented kernel limits: dtypes, head dims, layouts).
torch_npu is looked up at call time, so the documented-contract simulator in tests/npu_sim can stand in.
`MAPPINGS` records which torch_npu release each mapping needs (`since`, compared with the installed
torch_npu's release); docs/ops.md has the same table. Input limits of a SoC (the Ascend 950's indexer
head counts, the sparse flash attention's head counts on A2/A3) are checked per call: the reference (or
the next kernel) with one log line. Each mapping is probed once per process and mode before use: its
result is compared with the float64 reference (probes.py); a failing mode uses the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from slime.accelerator.ascend import fp8_ops, kda_ops, probes
from slime.accelerator.ascend.support import (
    documented_on, release_key, release_of, requirement, soc_of,
)
from slime.accelerator.ops import DeviceOp, log_once

# The op implementations live by group (dense_ops, attention_ops, moe_ops) over the shared kernel lookup
# (kernels); their names, and the switches _prepare sets, stay importable from here (the op table, the tests).
from slime.accelerator.ascend.kernels import (  # noqa: F401
    FLOATS, KERNEL_CALLS, LOW_PRECISION, _SOC, _at_least, _kernel, current_soc, has_kernel, torch_npu,
)
from slime.accelerator.ascend.dense_ops import _ROTARY_MODE_KW, _ROTARY_MODES, apply_rotary, rms_norm, swiglu  # noqa: F401
from slime.accelerator.ascend.attention_ops import (  # noqa: F401
    _SFA_OK, attention, compressed_causal_mask, lightning_indexer, sparse_attention,
)
from slime.accelerator.ascend.moe_ops import (  # noqa: F401
    _GMM_DW_KERNEL, _NATIVE_GATING_BACKWARD, grouped_matmul, moe_permute, moe_route, moe_unpermute,
)


@dataclass(frozen=True)
class NpuMapping:
    op: str
    kernels: tuple[str, ...]  # torch_npu functions that must exist
    since: str  # first PTA release (op-plugin branch) whose op_plugin_functions.yaml has them with the arguments used
    backward: str  # where the gradient comes from

    def requirement(self) -> str:
        return requirement(self.since)


MAPPINGS: dict[str, NpuMapping] = {
    m.op: m
    for m in (
        NpuMapping("rms_norm", ("npu_rms_norm",), "6.0.0", "native (npu_rms_norm_backward)"),
        NpuMapping("apply_rotary", ("npu_rotary_mul",), "6.0.0",
                   "native (npu_rotary_mul_backward); interleaved needs rotary_mode, 7.0.0+"),
        NpuMapping("attention", ("npu_fusion_attention",), "6.0.0", "native (npu_fusion_attention_grad)"),
        NpuMapping("sparse_attention", ("npu_fusion_attention",), "6.0.0",
                   "native; absorbed-MLA shapes use npu_sparse_flash_attention from 7.3.0 when present"),
        NpuMapping("lightning_indexer", ("npu_lightning_indexer",), "7.3.0", "none needed (integer output)"),
        NpuMapping("swiglu", ("npu_swiglu",), "6.0.0", "native (npu_swiglu_backward)"),
        NpuMapping("moe_route", ("npu_moe_gating_top_k",), "7.0.0",
                   "native (npu_moe_gating_top_k_backward from 26.1.0), else the reference backward"),
        NpuMapping("moe_permute", ("npu_moe_token_permute",), "7.2.0",
                   "native (npu_moe_token_permute_grad; npu_moe_token_permute_grad_v2 from 26.1.0)"),
        NpuMapping("moe_unpermute", ("npu_moe_token_unpermute",), "7.2.0", "native (npu_moe_token_unpermute_grad)"),
        NpuMapping("grouped_matmul", ("npu_grouped_matmul",), "7.0.0",
                   "slime autograd.Function: dx by a grouped matmul (group_type 0); dw by one (group_type 2) "
                   "from 26.0.0, per expert in torch before"),
    )
}

IMPLEMENTATIONS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "apply_rotary": apply_rotary,
    "attention": attention,
    "sparse_attention": sparse_attention,
    "lightning_indexer": lightning_indexer,
    "swiglu": swiglu,
    "moe_route": moe_route,
    "moe_permute": moe_permute,
    "moe_unpermute": moe_unpermute,
    "grouped_matmul": grouped_matmul,
}


_PROBED: dict[str, str] = {}  # "op" / "op[mode]" -> '' (probe passed) or why it failed; once per process


def _probe_once(op_name: str, acc, kernel: str, mode: str = "default") -> str:
    key = op_name if mode == "default" else f"{op_name}[{mode}]"
    if key not in _PROBED:
        _PROBED[key] = probes.probe(op_name, IMPLEMENTATIONS[op_name], acc.device(), KERNEL_CALLS, kernel, mode)
    return _PROBED[key]


def _prepare(op_name: str, acc, version: str) -> None:
    """Release- and SoC-dependent switches inside a mapping, decided before its probe."""
    if op_name == "apply_rotary":
        _ROTARY_MODE_KW[0] = _at_least("7.0.0")
        _ROTARY_MODES["half"] = True
        _ROTARY_MODES["interleave"] = _ROTARY_MODE_KW[0]  # kernels before 7.0.0 only rotate "half"
    elif op_name == "grouped_matmul":
        _GMM_DW_KERNEL[0] = _at_least("26.0.0")
    elif op_name == "moe_route":
        _NATIVE_GATING_BACKWARD[0] = _at_least("26.1.0") and has_kernel("npu_moe_gating_top_k_backward")
        if not _NATIVE_GATING_BACKWARD[0]:
            log_once(f"ops[npu].moe_route: torch_npu {version} has no npu_moe_gating_top_k backward (needs "
                     f"{requirement('26.1.0')}); forward on the kernel, backward by the reference")
    elif op_name == "sparse_attention":
        _SFA_OK[0] = _at_least("7.3.0") and has_kernel("npu_sparse_flash_attention")
        if _SFA_OK[0]:
            if "sparse_attention_absorbed" not in _PROBED:
                _PROBED["sparse_attention_absorbed"] = probes.probe(
                    "sparse_attention_absorbed", sparse_attention, acc.device(), KERNEL_CALLS, "npu_sparse_flash_attention")
            why = _PROBED["sparse_attention_absorbed"]
            if why:
                _SFA_OK[0] = False
                log_once(f"ops[npu].sparse_attention: probe of torch_npu.npu_sparse_flash_attention (mode absorbed "
                         f"MLA, TND) on {current_soc()} failed: {why}; absorbed-MLA shapes use npu_fusion_attention "
                         f"per sequence")


def _modes(op_name: str) -> list[str]:
    """The probe modes the installed release has (interleave rotary needs rotary_mode)."""
    if op_name == "apply_rotary":
        return [m for m in probes.modes(op_name) if _ROTARY_MODES[m]]
    return list(probes.modes(op_name))


def _probe_modes(op_name: str, acc, kernel: str, soc: str) -> str:
    """Probe every mode; a failing mode is switched to the reference with one log line. '' when the
    kernel runs in at least one mode, else why not."""
    if op_name == "grouped_matmul":  # dw by group_type 2 (undocumented), else dw per expert in torch
        results = {"dw_group_type_2": _probe_once(op_name, acc, kernel, "dw_group_type_2")} if _GMM_DW_KERNEL[0] else {}
        if not results or results["dw_group_type_2"]:
            _GMM_DW_KERNEL[0] = False
            results["dw_per_expert"] = _probe_once(op_name, acc, kernel, "dw_per_expert")
            if not results["dw_per_expert"] and len(results) == 2:
                log_once(f"ops[npu].grouped_matmul: probe of torch_npu.npu_grouped_matmul (mode dw_group_type_2) on "
                         f"{soc} failed: {results['dw_group_type_2']}; dw per expert in torch")
                return ""
    else:
        results = {m: _probe_once(op_name, acc, kernel, m) for m in _modes(op_name)}
    failed = {m: why for m, why in results.items() if why}
    if failed and len(failed) == len(results):
        mode, why = next(iter(failed.items()))
        return f"probe of torch_npu.{kernel} (mode {mode}) on {soc} failed: {why}"
    for mode, why in failed.items():
        if op_name == "apply_rotary":
            _ROTARY_MODES[mode] = False
        log_once(f"ops[npu].{op_name}: probe of torch_npu.{kernel} (mode {mode}) on {soc} failed: {why}; "
                 f"{mode} uses the reference")
    return ""


def resolve(op_name: str, acc) -> DeviceOp | None:
    """Provider hook for slime.accelerator.ops: the Ascend implementation of `op_name`, or why not.
    Order: torch_npu imports; its release is at least the mapping's `since`; the kernels exist; the
    one-time probe passes on this SoC."""
    if op_name in kda_ops.OPS:  # GLM-5.3-Flash's KDA ops: sgl-kernel-npu kernels or the reference (kda_ops.py)
        if not _SOC:
            _SOC.append(soc_of(acc.device_name()))
        return kda_ops.resolve(op_name, current_soc(), lambda op, fn, kernel: _probe_kda(op, fn, acc, kernel))
    if op_name in fp8_ops.OPS:  # block-FP8 weight quantization for an FP8 engine (fp8_ops.py)
        return fp8_ops.resolve(op_name, acc)
    mapping = MAPPINGS.get(op_name)
    if mapping is None:
        return None  # no fused kernel worth it (token_log_probs: the chunked torch reference)
    try:
        npu = torch_npu()
    except Exception as e:
        return DeviceOp(None, "", f"import torch_npu failed: {type(e).__name__}: {e}")
    version = str(getattr(npu, "__version__", "unknown"))
    release = release_of(version)
    if release is None:
        return DeviceOp(None, "", f"torch_npu {version} is not in slime's release table "
                                  f"(slime/accelerator/ascend/support.py); {op_name} ({', '.join(mapping.kernels)}) "
                                  f"needs {mapping.requirement()}")
    if release_key(release) < release_key(mapping.since):
        return DeviceOp(None, "", f"torch_npu {version} is Ascend PyTorch {release}; {op_name} "
                                  f"({', '.join(mapping.kernels)}) needs {mapping.requirement()}")
    missing = [k for k in mapping.kernels if not has_kernel(k)]
    if missing:
        return DeviceOp(None, "", f"torch_npu {version} lacks {', '.join(missing)}; needs {mapping.requirement()}")
    if not _SOC:
        _SOC.append(soc_of(acc.device_name()))
    soc = current_soc()
    _prepare(op_name, acc, version)
    kernel = mapping.kernels[0]
    why = _probe_modes(op_name, acc, kernel, soc)
    if why:
        return DeviceOp(None, "", why)
    if not documented_on(kernel, soc):
        log_once(f"ops[npu].{op_name}: torch_npu.{kernel} is not documented for {soc}; its probe passed, using it")
    return DeviceOp(IMPLEMENTATIONS[op_name], "torch_npu." + kernel)


def _probe_kda(op_name: str, fn: Callable, acc, kernel: str) -> str:
    if op_name not in _PROBED:
        _PROBED[op_name] = probes.probe(op_name, fn, acc.device(), kda_ops.KERNEL_CALLS, kernel)
    return _PROBED[op_name]


def probe_results() -> tuple[dict[str, str], list[str]]:
    """The per-process probe results and SoC, for restore_probe_results (the simulator's tests reuse them)."""
    return dict(_PROBED), list(_SOC)


def restore_probe_results(saved: tuple[dict[str, str], list[str]]) -> None:
    _PROBED.update(saved[0])
    _SOC[:] = saved[1]


def forget_probes() -> None:
    """Forget the per-process probe results and SoC (tests switch simulated releases and SoCs)."""
    _PROBED.clear()
    _SOC.clear()
    _SFA_OK[0] = False
    _ROTARY_MODES.update(half=True, interleave=True)
    _GMM_DW_KERNEL[0] = True
