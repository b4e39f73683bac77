"""Megatron DDP + optimizer for a model built by slime (or any megatron module) on the accelerator.

    ddp, opt = build_optimizer(model, lr=1e-6, clip_grad=1.0, memory=MemoryOptions(use_distributed_optimizer=True))
    ddp.zero_grad_buffer(); opt.zero_grad()
    loss = ...(ddp(input_ids, position_ids)); loss.backward()
    ddp.finish_grad_sync()          # or megatron.core.distributed.finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()   # grad_norm is measured before clipping

Everything is Megatron's own: DistributedDataParallel, get_megatron_optimizer (DistributedOptimizer,
HybridDeviceOptimizer for CPU offload); the accelerator's patch set supplies what a device lacks.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from slime.backends.megatron.parallel import apply_megatron_patches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryOptions:
    """Megatron's optimizer-memory options, named as their train.py flags."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MemoryOptions":
        """From parsed args, which carry every one of these flags at its parser default."""
        return cls(use_distributed_optimizer=args.use_distributed_optimizer,
                   overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
                   optimizer_cpu_offload=args.optimizer_cpu_offload,
                   optimizer_offload_fraction=args.optimizer_offload_fraction,
                   overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
                   use_precision_aware_optimizer=args.use_precision_aware_optimizer)


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's training dtype: bf16 when any parameter is bf16 (float32 ones, e.g. the MoE router,
    then get float32 optimizer groups), else float32."""
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.bfloat16}:
        raise ValueError(f"megatron optimizer supports float32/bfloat16 parameters, got {sorted(map(str, dtypes))}")
    return torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32


def _check_precision_aware(memory: MemoryOptions) -> None:
    """Megatron's precision-aware Adam is TransformerEngine's FusedAdam, or the host optimizer under offload."""
    if not memory.use_precision_aware_optimizer or memory.optimizer_cpu_offload:
        return
    try:
        import transformer_engine.pytorch.optimizers  # noqa: F401
    except ImportError:
        raise ValueError("--use-precision-aware-optimizer needs TransformerEngine's FusedAdam, which is not installed "
                         "here; add --optimizer-cpu-offload (host Adam) or drop the flag") from None


def _note_overlap(memory: MemoryOptions) -> None:
    from slime.accelerator import get_accelerator

    if (memory.overlap_grad_reduce or memory.overlap_param_gather) and get_accelerator().is_synchronized_device():
        logger.info("%s has no device streams: --overlap-grad-reduce/--overlap-param-gather run as asynchronous "
                    "collectives on the backend's own threads, sharing the host cores with compute",
                    get_accelerator().name)


def build_optimizer(model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0, adam_beta1: float = 0.9,
                    adam_beta2: float = 0.95, adam_eps: float = 1e-8, clip_grad: float = 1.0, bf16: bool | None = None,
                    use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                    min_lr: float | None = None, memory: MemoryOptions | None = None, optimizer: str = "adam",
                    sgd_momentum: float = 0.9):
    """Wrap `model` in megatron DDP (grads reduced in fp32) and build megatron's `optimizer` (adam or sgd) on it.
    bf16=None follows the parameters' dtype; bf16 keeps fp32 main params inside the optimizer.
    `memory` (distributed optimizer, overlap, CPU offload, precision-aware) overrides the two shorthand
    flags. Returns (ddp_model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    memory = memory or MemoryOptions(use_distributed_optimizer=use_distributed_optimizer,
                                     overlap_grad_reduce=overlap_grad_reduce)
    _check_precision_aware(memory)
    _note_overlap(memory)
    apply_megatron_patches()
    dtype = _param_dtype(model)
    if bf16 is None:
        bf16 = dtype == torch.bfloat16
    if bf16 != (dtype == torch.bfloat16):
        raise ValueError(f"bf16={bf16} but the model parameters are {dtype}; cast the model or change bf16")
    config = model.config
    config.bf16, config.params_dtype = bf16, dtype
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=memory.overlap_grad_reduce,
            overlap_param_gather=memory.overlap_param_gather,
            use_distributed_optimizer=memory.use_distributed_optimizer),
        module=model,
    )
    opt_config = OptimizerConfig(
        optimizer=optimizer, sgd_momentum=sgd_momentum, lr=lr, min_lr=lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad, bf16=bf16,
        fp16=False, params_dtype=dtype, use_distributed_optimizer=memory.use_distributed_optimizer,
        optimizer_cpu_offload=memory.optimizer_cpu_offload,
        optimizer_offload_fraction=memory.optimizer_offload_fraction if memory.optimizer_cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=memory.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=memory.use_precision_aware_optimizer,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def sync_params(model) -> None:
    """With --overlap-param-gather the updated params are all-gathered by the next forward's hooks; anything
    reading them before that (weight sync, export, save) needs the gather finished now."""
    if getattr(model, "use_forward_hook", False):
        model.start_param_sync(force_sync=True)


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers holding the state under Megatron's wrappers (chained, distributed, host offload)."""
    out = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        out.append(inner)
        out.extend(getattr(inner, "sub_optimizers", []))  # HybridDeviceOptimizer: its device and host Adams
    return out


def reset_optimizer_states(optimizer) -> None:
    """--reset-optimizer-states (upstream's): Adam starts over: step counts and both moments zeroed in place
    (the buffers stay allocated, so a later step or a checkpoint sees the same tensors)."""
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in opt.state.values():
            for key, value in state.items():
                if key == "step":
                    if isinstance(value, torch.Tensor):
                        value.zero_()
                    else:
                        state[key] = 0
                elif key in ("exp_avg", "exp_avg_sq") and isinstance(value, torch.Tensor):
                    value.zero_()
