"""Shared pieces of the SIMULATED torch_npu ops: errors, the simulated release, missing derivatives."""

from __future__ import annotations

import torch

# Newest simulated Ascend PyTorch (op-plugin) release and its torch_npu wheel.
NEWEST_RELEASE = "26.1.0"
RELEASE_WHEELS = {
    "6.0.0": "2.4.0.post2", "7.0.0": "2.5.1", "7.1.0": "2.6.0", "7.2.0": "2.8.0",
    "7.3.0": "2.9.0", "26.0.0": "2.9.0.post2", "26.1.0": "2.12.0",
}
_release = [NEWEST_RELEASE]

# Simulated SoCs and the device names torch.npu.get_device_name() reports for them.
SOC_DEVICE_NAMES = {"A2": "Ascend910B3", "A3": "Ascend910_9392", "950PR": "Ascend950PR", "950DT": "Ascend950DT"}
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
