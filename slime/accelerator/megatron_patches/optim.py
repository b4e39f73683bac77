"""DDP grad buffers, megatron optimizers and gradient clipping.

Short functions with `device='cuda'` literals are re-implemented here; long ones whose only device
dependence is `torch.cuda.<call>` (and the optimizers' `param.type() == 'torch.cuda.FloatTensor'`
checks) are re-bound with `device_shim.with_accelerator_torch` instead of being copied.
Optimizer CPU offload (HybridDeviceOptimizer) is in offload.py. Not covered (not used by slime): fp16 grad
scalers, count_zeros_fp32 (log_num_zeros_in_grad), distributed-optimizer checkpoint save/load over non-gloo paths.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch
from slime.accelerator.megatron_patches.offload import make_fp32_shards_as_leaves
from slime.accelerator.patches import Patch

BUFFER = "megatron.core.distributed.param_and_grad_buffer"
DDP = "megatron.core.distributed.distributed_data_parallel"
CLIP = "megatron.core.optimizer.clip_grads"
OPT = "megatron.core.optimizer.optimizer"
DIST_OPT = "megatron.core.optimizer.distrib_optimizer"


def _device() -> torch.device:
    from slime.accelerator import get_accelerator

    return get_accelerator().current_device()


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Total p-norm of the grads, reduced over `grad_stats_parallel_group` (and the FSDP data-parallel
    group of DTensor grads), as megatron's get_grad_norm_fp32, on the accelerator."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None
    for g in grads_for_norm:
        dp_group = get_data_parallel_group_if_dtensor(g, dp_group)
    grads = [to_local_if_dtensor(g) for g in grads_for_norm]
    p = float(norm_type)
    if p == math.inf:
        local = max((float(g.abs().max()) for g in grads), default=0.0)
        total = torch.tensor([local], dtype=torch.float32, device=_device())
        op = dist.ReduceOp.MAX
    else:
        total = torch.zeros(1, dtype=torch.float32, device=_device())
        for g in grads:
            total += torch.linalg.vector_norm(g.float(), p) ** p
        op = dist.ReduceOp.SUM
    if dp_group:
        dist.all_reduce(total, op=op, group=dp_group)
    dist.all_reduce(total, op=op, group=grad_stats_parallel_group)
    return total.item() if p == math.inf else total.item() ** (1.0 / p)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """Scale fp32 (or bf16 decoupled) grads in place by max_norm / total_norm when that is < 1."""
    from megatron.core.utils import to_local_if_dtensor

    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        g = getattr(param, attr, None)
        if g is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if g.dtype not in allowed:
            raise TypeError(f"clip_grad_by_total_norm_fp32 expects {allowed} grads, got {g.dtype}")
        grads.append(to_local_if_dtensor(g).detach())
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


def make_fp32_optimizer_init(original):
    def __init__(self, optimizer, config, init_state_fn):
        from megatron.core.optimizer.optimizer import MegatronOptimizer

        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0], dtype=torch.float32, device=_device())
        self.is_stub_optimizer = optimizer is None

    return __init__


def make_mixed_precision_init(original):
    def __init__(self, optimizer, config, grad_scaler, init_state_fn):
        from megatron.core.optimizer.optimizer import MegatronOptimizer

        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self.grad_scaler = grad_scaler
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (set loss_scale or dynamic loss scaling)")
        dev = _device()
        if grad_scaler:
            self.found_inf = torch.tensor([0.0], dtype=torch.float32, device=dev)
        self._dummy_overflow_buf = None if config.bf16 else torch.tensor([0], dtype=torch.int, device=dev)
        if grad_scaler is None:
            self._scale_one = torch.tensor([1.0], dtype=torch.float32, device=dev)

    return __init__


def make_distributed_optimizer_load_state_dict(original):
    """DistributedOptimizer.load_state_dict, re-bound to the accelerator, then giving every parameter its own
    Adam `step` tensor: for torch's Adam (no apex / TransformerEngine) the original stores ONE step tensor in
    every parameter's state, which torch's Adam then increments once per parameter per step."""
    rebound = with_accelerator_torch(original)

    def load_state_dict(self, state_dict):
        rebound(self, state_dict)
        inner = getattr(self, "optimizer", None)
        for opt in [inner, *getattr(inner, "sub_optimizers", [])]:
            for state in (opt.state.values() if opt is not None else ()):
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    state["step"] = step.detach().clone()

    return load_state_dict


def _fresh_torch_adam_state(opt) -> None:
    """torch Adam's own first-step state (step 0, zero moments) for every param that has none yet: the
    same update as torch's lazy initialisation, but present for megatron's state_dict / checkpointing."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state.get(p):
                opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}


def _state_dict_without_params(self, inner) -> dict:
    """The original's layout (param groups without params, step 0, grad scaler) for a shard holding no params."""
    groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0} for g in inner.state_dict()["param_groups"]]
    out = {"optimizer": {"param_groups": groups}}
    if self.grad_scaler:
        out["grad_scaler"] = self.grad_scaler.state_dict()
    return out


def make_distributed_optimizer_state_dict(original):
    """DistributedOptimizer.state_dict before the first step, or of a shard without params: for torch's Adam
    (no apex / TransformerEngine) the original asserts exactly one Adam step count across the (empty) state.
    Give the params torch Adam's initial state first (an unchanged next step), so saving, and resuming into,
    a fresh optimizer work; a shard without params gets the original's layout with step 0. The same for
    --optimizer-cpu-offload's HybridDeviceOptimizer (without apex / TE the original takes the torch-Adam
    path for it too): its CPU and device sub-optimizers (torch Adam / AdamW) get the initial state, which
    the hybrid optimizer then mirrors, as it does after each of its steps."""

    def state_dict(self):
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and not inner.state:
            if not any(g["params"] for g in inner.param_groups):  # e.g. a pipeline stage without experts
                return _state_dict_without_params(self, inner)
            _fresh_torch_adam_state(inner)
        elif isinstance(inner, HybridDeviceOptimizer) and not any(inner.state.values()):
            subs = [o for o in inner.sub_optimizers if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]
            if subs and len(subs) == len(inner.sub_optimizers):
                for sub in subs:
                    _fresh_torch_adam_state(sub)
                inner._sync_sub_optimizers_state_to_hdo()
        return original(self)

    return state_dict


def make_te_min_version(original):
    """is_te_min_version that answers False when TransformerEngine is not installed (the original compares
    None with a version and raises TypeError)."""

    def is_te_min_version(version, check_equality=True):
        from megatron.core.utils import get_te_version

        if get_te_version() is None:
            return False
        return original(version, check_equality)

    return is_te_min_version


def _p(name, targets, replacement, why, replaces, remove_when="megatron-core's optimizer stack takes its "
       "device from the parameters / an accelerator API instead of CUDA literals"):
    return Patch(name=name, targets=tuple(targets), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS, remove_when=remove_when)


_rebind = with_accelerator_torch


def _rebind_types(f):
    return with_accelerator_torch(f, tensor_type_names=True)


PATCHES = [
    _p("ddp_grad_buffer_device", [f"{BUFFER}:_ParamAndGradBuffer.__init__"], _rebind,
       "megatron DDP allocates its contiguous param/grad buffers at wrap time",
       "torch.cuda.current_device() for the grad (and distributed-optimizer param) buffers; re-bound, not copied"),
    _p("ddp_streams", [f"{DDP}:DistributedDataParallel.__init__",
                       f"{BUFFER}:_ParamAndGradBucketGroup.start_grad_sync",
                       f"{BUFFER}:_ParamAndGradBucketGroup.finish_grad_sync"], _rebind,
       "DDP grad reduction (communication streams with several distributed-optimizer instances)",
       "torch.cuda.Stream / torch.cuda.stream / torch.cuda.default_stream; re-bound to the accelerator's"),
    _p("grad_norm_device", [f"{CLIP}:get_grad_norm_fp32"], lambda o: get_grad_norm_fp32,
       "every optimizer step computes the global grad norm (clip_grad, logging)",
       "torch.zeros/tensor(..., device='cuda') accumulators in get_grad_norm_fp32 (its `from .clip_grads import` "
       "bindings in optimizer.py / layer_wise_optimizer.py are found and replaced by the registry's alias sweep)"),
    _p("clip_grads_device", [f"{CLIP}:clip_grad_by_total_norm_fp32"],
       lambda o: clip_grad_by_total_norm_fp32,
       "gradient clipping (clip_grad > 0)",
       "the `param.grad.type() == 'torch.cuda.FloatTensor'` assert and device='cuda' overflow buffer"),
    _p("fp32_optimizer_init", [f"{OPT}:FP32Optimizer.__init__"], make_fp32_optimizer_init,
       "fp32 training wraps the torch optimizer in FP32Optimizer",
       "torch.tensor([1.0], device='cuda') loss scale in FP32Optimizer.__init__"),
    _p("mixed_precision_optimizer_init", [f"{OPT}:MixedPrecisionOptimizer.__init__"], make_mixed_precision_init,
       "bf16 training (Float16 and distributed optimizers) builds on MixedPrecisionOptimizer",
       "device='cuda' found_inf / overflow / unit-scale tensors in MixedPrecisionOptimizer.__init__"),
    _p("float16_optimizer_param_types", [f"{OPT}:Float16OptimizerWithFloat16Params.__init__"], _rebind_types,
       "bf16 training without the distributed optimizer keeps fp32 main params per bf16 param",
       "param.type() comparisons against 'torch.cuda.*Tensor' (re-bound to this accelerator's type names)"),
    _p("distributed_optimizer_param_types", [f"{DIST_OPT}:DistributedOptimizer.__init__"], _rebind_types,
       "the distributed optimizer shards main params and optimizer state across data-parallel ranks",
       "param.type() comparisons against 'torch.cuda.*Tensor' (re-bound to this accelerator's type names)"),
    _p("distributed_optimizer_main_param_groups",
       [f"{DIST_OPT}:DistributedOptimizer._build_model_and_main_param_groups"],
       lambda orig: make_fp32_shards_as_leaves(_rebind_types(orig)),
       "the distributed optimizer builds each rank's shard of main params (float32 ones as views of the params)",
       "param.type() comparisons against 'torch.cuda.*Tensor' (re-bound to this accelerator's type names); with "
       "--optimizer-cpu-offload also the non-leaf fp32 shard views, which HybridDeviceOptimizer (built through "
       "torch's Optimizer constructor) rejects with \"can't optimize a non-leaf Tensor\": they become detached "
       "views sharing the param's storage, as megatron already makes the bf16 shards"),
    _p("distributed_optimizer_state_dict_before_first_step", [f"{DIST_OPT}:DistributedOptimizer.state_dict"],
       make_distributed_optimizer_state_dict,
       "checkpoints save, and resume into, distributed optimizers that have not stepped yet",
       "`assert len(steps) == 1` over torch Adam's empty lazy state (megatron's apex/TE FusedAdam path has no "
       "such state; on CPU and Ascend torch's Adam runs), also for --optimizer-cpu-offload's HybridDeviceOptimizer "
       "(its torch Adam sub-optimizers), which made a resume with CPU offload fail",
       remove_when="megatron-core's DistributedOptimizer.state_dict handles an unstepped torch Adam"),
    _p("distributed_optimizer_load_state_dict", [f"{DIST_OPT}:DistributedOptimizer.load_state_dict"],
       make_distributed_optimizer_load_state_dict,
       "resuming a checkpoint with the distributed optimizer allocates each shard's Adam state before filling it",
       "torch.empty(..., device=torch.cuda.current_device()) placeholders (re-bound), and the single `step` tensor "
       "shared by every parameter's torch-Adam state (each parameter gets its own copy)",
       remove_when="megatron-core allocates on the accelerator and gives torch Adam one step tensor per parameter"),
    _p("te_version_without_te", ["megatron.core.utils:is_te_min_version"], make_te_min_version,
       "--use-precision-aware-optimizer (OptimizerConfig and get_megatron_optimizer ask for TE's version); "
       "every binding of the function is replaced, and it only changes the answer where TE is absent",
       "get_te_version() >= Version(...) with get_te_version() None when TransformerEngine is absent (TypeError)",
       remove_when="megatron-core's is_te_min_version handles a missing TransformerEngine"),
    _p("chained_optimizer_loss_scale", [f"{OPT}:ChainedOptimizer.get_loss_scale"], _rebind,
       "an empty chained optimizer (e.g. a pipeline stage without params) reports a unit loss scale",
       "torch.cuda.current_device() in ChainedOptimizer.get_loss_scale"),
]
