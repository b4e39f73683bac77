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
