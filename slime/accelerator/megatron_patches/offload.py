"""Optimizer CPU offload: megatron's HybridDeviceOptimizer (--optimizer-cpu-offload).

The original decides what to offload with `param.is_cuda`, copies offloaded params to pinned host memory
and runs the copies on `torch.cuda` streams. Here "on the device" means on the accelerator's device type
(cuda, npu), streams come from the accelerator, and on the CPU accelerator - where the params already live
on the host - every param is its own host copy: the same host-optimizer path runs (grads handed to the host
Adam, updated values copied back) and nothing moves or gets pinned (pinning needs a device runtime).
"""

from __future__ import annotations

import inspect

import torch

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch
from slime.accelerator.patches import Patch

HYBRID = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer"


def _device_type() -> str:
    from slime.accelerator import get_accelerator

    return get_accelerator().device_type


def make_hybrid_init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if _device_type() == "cpu":
            bound.arguments["pin_cpu_grads"] = bound.arguments["pin_cpu_params"] = False
        original(*bound.args, **bound.kwargs)

    return __init__


def sub_optimizer_param_groups(self, offload_fraction: float):
    """(host groups, device groups, device param -> host copy, host copy -> device param, param -> fp32 copy),
    as the original returns them. The first `offload_fraction` of the device-resident elements get host copies;
    on the CPU accelerator all params are host-resident and each is its own copy (the fraction is moot)."""
    device_type = _device_type()
    on_host = device_type == "cpu"
    resident = [p for g in self.param_groups for p in g["params"] if p.device.type == device_type]
    threshold = sum(p.numel() for p in resident) * offload_fraction
    offloaded = 0
    host_groups, device_groups = [], []
    to_copy, from_copy, fp32_copy = {}, {}, {}
    for group in self.param_groups:
        host_group, device_group = {**group, "params": []}, {**group, "params": []}
        for orig in group["params"]:
            param, copied = orig, False
            if orig.device.type == device_type and (on_host or offloaded < threshold):
                param = orig if on_host else orig.detach().clone().cpu().pin_memory()
                offloaded += param.numel()
                copied = True
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                fp32_copy[orig] = param
            if copied:
                to_copy[orig], from_copy[param] = param, orig
            (host_group if param.device.type == "cpu" else device_group)["params"].append(param)
        for kept, groups in ((host_group, host_groups), (device_group, device_groups)):
            if kept["params"]:
                groups.append(kept)
    return host_groups, device_groups, to_copy, from_copy, fp32_copy


def make_fp32_shards_as_leaves(original):
    """DistributedOptimizer._build_model_and_main_param_groups with --optimizer-cpu-offload: the fp32 params'
    shards become detached views (leaves sharing the param's storage, as megatron already makes the bf16
    shards). HybridDeviceOptimizer is built through torch's Optimizer constructor, which rejects the
    original's non-leaf `model_param.view(-1)[a:b]` shards. Registered in optim.py (same target as the
    type-name re-binding there)."""
    func = original.__func__ if isinstance(original, classmethod) else original

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = func(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if not config.optimizer_cpu_offload:
            return groups
        from megatron.core import tensor_parallel

        leaves = {}
        for group in groups[3]:  # shard_fp32_groups
            for i, view in enumerate(group):
                leaf = view.detach()
                tensor_parallel.copy_tensor_model_parallel_attributes(leaf, view)
                if hasattr(view, "shared"):
                    leaf.shared = view.shared
                leaves[id(view)] = group[i] = leaf
        for group_range in opt_group_ranges:
            orig = group_range["orig_group"]
            orig["params"] = [leaves.get(id(p), p) for p in orig["params"]]
        return groups

    return classmethod(build)


def update_fp32_params_by_new_state(self) -> None:
    """After a checkpoint load: copy each loaded master param into its fp32 copy, for the params that have
    one (param_update_in_fp32 copies only the non-float32 params; a float32 param is its own master)."""
    if not self.param_update_in_fp32:
        return
    for param, state in self.state.items():
        fp32 = self.param_to_fp32_param.get(param)
        if fp32 is not None:
            fp32.data.copy_(state["master_param"])


def _p(name, targets, replacement, why, replaces,
       remove_when="megatron-core's HybridDeviceOptimizer takes device, streams and pinning from an "
                   "accelerator API instead of torch.cuda / is_cuda"):
    return Patch(name=name, targets=tuple(targets), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS, remove_when=remove_when)


PATCHES = [
    _p("hybrid_optimizer_no_pinning_on_host", [f"{HYBRID}.__init__"], make_hybrid_init,
       "--optimizer-cpu-offload on the CPU accelerator",
       "pin_cpu_grads / pin_cpu_params (pin_memory needs a device runtime; on the host there is nothing to pin)"),
    _p("hybrid_optimizer_offload_split", [f"{HYBRID}._get_sub_optimizer_param_groups"],
       lambda orig: sub_optimizer_param_groups,
       "--optimizer-cpu-offload decides which params' optimizer state goes to the host",
       "`param.is_cuda` (False for NPU tensors, so nothing was offloaded there; on CPU host params had no copy "
       "mapping and the host optimizer raised KeyError)"),
    _p("hybrid_optimizer_streams", [f"{HYBRID}._init_sub_optimizers", f"{HYBRID}.step",
                                    f"{HYBRID}._register_param_copy_back_gpu_hook"], with_accelerator_torch,
       "the host optimizer's grad (D2H) and param (H2D) copies, on side streams with --overlap-cpu-optimizer-d2h-h2d",
       "torch.cuda.current_stream / Stream / stream (re-bound to the accelerator's; CPU: null streams)"),
    _p("hybrid_optimizer_state_device", [f"{HYBRID}._move_new_state_to_right_device"],
       lambda orig: with_accelerator_torch(orig, device_literal=True),
       "loading a checkpoint into the offloading optimizer moves the device optimizer's state back",
       'v.to("cuda") for the device sub-optimizer\'s state ("cuda" -> the accelerator\'s device type)'),
    _p("hybrid_optimizer_fp32_masters_on_load", [f"{HYBRID}._update_fp32_params_by_new_state"],
       lambda orig: update_fp32_params_by_new_state,
       "resuming a checkpoint with --optimizer-cpu-offload and float32 params (the CPU runs and tests train in "
       "float32; any run with some float32 params, e.g. norms kept in fp32)",
       "`self.param_to_fp32_param[param]` for every param, a KeyError for the float32 params, which have no "
       "fp32 copy (the offloading optimizer is built with param_update_in_fp32 for every dtype)",
       remove_when="megatron-core's HybridDeviceOptimizer skips params without an fp32 copy on load"),
]
