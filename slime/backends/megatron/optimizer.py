"""Megatron DDP + optimizer for a model built by slime (or any megatron module) on the accelerator.

    ddp, opt = build_optimizer(model, lr=1e-6, clip_grad=1.0)
    ddp.zero_grad_buffer(); opt.zero_grad()
    loss = ...(ddp(input_ids, position_ids)); loss.backward()
    ddp.finish_grad_sync()          # or megatron.core.distributed.finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()   # grad_norm is measured before clipping
"""

from __future__ import annotations

import torch

from slime.backends.megatron.parallel import apply_megatron_patches


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's training dtype: bf16 when any parameter is bf16 (float32 ones, e.g. the MoE router,
    then get float32 optimizer groups), else float32."""
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.bfloat16}:
        raise ValueError(f"megatron optimizer supports float32/bfloat16 parameters, got {sorted(map(str, dtypes))}")
    return torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32


def build_optimizer(model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0, adam_beta1: float = 0.9,
                    adam_beta2: float = 0.95, adam_eps: float = 1e-8, clip_grad: float = 1.0, bf16: bool | None = None,
                    use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                    min_lr: float | None = None):
    """Wrap `model` in megatron DDP (grads reduced in fp32) and build megatron Adam on it.
    bf16=None follows the parameters' dtype; bf16 keeps fp32 main params inside the optimizer.
    Returns (ddp_model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

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
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                                 use_distributed_optimizer=use_distributed_optimizer),
        module=model,
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr if min_lr is None else min_lr, weight_decay=weight_decay,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad, bf16=bf16,
        fp16=False, params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])
