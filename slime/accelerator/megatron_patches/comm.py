"""Collectives in megatron's tensor-parallel mappings and linear layers.

The originals allocate their outputs on `torch.cuda.current_device()`; the replacements allocate on the
input's device. gloo's all_to_all_single only takes Python lists as split sizes, while megatron's MoE
dispatcher passes CPU tensors / numpy arrays when the device is not CUDA.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch

MAPPINGS = "megatron.core.tensor_parallel.mappings"
LAYERS = "megatron.core.tensor_parallel.layers"


def _mappings():
    return importlib.import_module(MAPPINGS)


def split_sizes_as_list(sizes):
    """None, a list, a tensor or a numpy array of split sizes -> None or list[int]."""
    if sizes is None:
        return None
    if hasattr(sizes, "tolist"):
        sizes = sizes.tolist()
    return [int(s) for s in sizes]


def gather_along_last_dim(input_, group):
    world = group.size()
    if world == 1:
        return input_
    out = torch.empty((input_.shape[0] * world, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    _mappings().dist_all_gather_func(out, input_.contiguous(), group=group)
    return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()


def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    assert group is not None, "group should not be None"
    world = group.size()
    if world == 1:
        return input_
    m = _mappings()
    sizes = split_sizes_as_list(output_split_sizes)
    rows = input_.shape[0] * world if sizes is None else sum(sizes)
    shape = [rows, *input_.shape[1:]]
    if use_global_buffer:
        out = m.get_global_memory_buffer().get_tensor(shape, input_.dtype, "mpu")
    else:
        out = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    if sizes is None:
        m.dist_all_gather_func(out, input_.contiguous(), group=group)
    else:
        dist.all_gather(list(torch.split(out, sizes, dim=0)), input_.contiguous(), group=group)
    return out


def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    assert group is not None, "group should not be None"
    world = group.size()
    if world == 1:
        return input_
    m = _mappings()
    sizes = split_sizes_as_list(input_split_sizes)
    if sizes is None:
        if input_.shape[0] % world:
            raise ValueError(f"first dim {input_.shape[0]} is not divisible by the group size {world}")
        shape = [input_.shape[0] // world, *input_.shape[1:]]
        if use_global_buffer:
            out = m.get_global_memory_buffer().get_tensor(shape, input_.dtype, "mpu")
        else:
            out = torch.empty(shape, dtype=input_.dtype, device=input_.device)
        m.dist_reduce_scatter_func(out, input_.contiguous(), group=group)
        return out
    parts = [p.contiguous() for p in torch.split(input_, sizes, dim=0)]
    mine = parts[group.rank()]
    if use_global_buffer:
        out = m.get_global_memory_buffer().get_tensor(mine.shape, input_.dtype, "mpu")
    else:
        out = torch.empty_like(mine)
    dist.reduce_scatter(out, parts, group=group)
    return out


def all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes):
    """_AllToAll.forward: split sizes as lists (gloo), output on the input's device."""
    out_sizes, in_sizes = split_sizes_as_list(output_split_sizes), split_sizes_as_list(input_split_sizes)
    ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, out_sizes, in_sizes
    if group.size() == 1:
        return input
    input = input.contiguous()
    if out_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty((sum(out_sizes), *input.shape[1:]))
    dist.all_to_all_single(output, input, output_split_sizes=out_sizes, input_split_sizes=in_sizes, group=group)
    return output


def make_linear_backward(original):
    """LinearWithGradAccumulationAndAsyncCommunication.backward: the sequence-parallel branch allocates
    the reduce-scattered input grad on torch.cuda.current_device(); redo that branch device-agnostically
    (synchronous collectives) and delegate everything else to the original."""
    orig_fn = original.__func__ if isinstance(original, staticmethod) else original

    def backward(ctx, grad_output):
        if not ctx.sequence_parallel or ctx.gradient_accumulation_fusion:
            return orig_fn(ctx, grad_output)
        layers = importlib.import_module(LAYERS)
        m = _mappings()
        input, weight = ctx.saved_tensors
        group = ctx.tp_group
        buffer, limit = ctx.grad_output_buffer, ctx.wgrad_deferral_limit
        wgrad_compute = True
        if buffer is not None and (limit == 0 or len(buffer) < limit):
            buffer.append(grad_output)
            wgrad_compute = False
        grad_input = grad_output.matmul(weight)
        sub_grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        m.dist_reduce_scatter_func(sub_grad_input, grad_input.contiguous(), group=group)
        grad_weight = None
        if wgrad_compute:
            shape = [input.shape[0] * group.size(), *input.shape[1:]]
            total_input = m.get_global_memory_buffer().get_tensor(shape, input.dtype, "mpu")
            m.dist_all_gather_func(total_input, input.contiguous(), group=group)
            grad_output, total_input = layers.prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
            grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return (sub_grad_input, grad_weight, grad_bias, None, None, None, None, None, None)

    return staticmethod(backward)


def _p(name, target, replacement, why, replaces):
    return Patch(name=name, targets=(target,), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS,
                 remove_when="megatron-core allocates collective outputs on the input tensor's device")


PATCHES = [
    _p("tp_gather_last_dim", f"{MAPPINGS}:_gather_along_last_dim", lambda o: gather_along_last_dim,
       "tensor-parallel output gathering (gather_output, vocab-parallel logits gather)",
       "torch.empty(..., device=torch.cuda.current_device()) in _gather_along_last_dim"),
    _p("tp_gather_first_dim", f"{MAPPINGS}:_gather_along_first_dim", lambda o: gather_along_first_dim,
       "sequence parallel and the MoE dispatchers all-gather along the token dimension",
       "torch.empty(..., device=torch.cuda.current_device()) in _gather_along_first_dim"),
    _p("tp_reduce_scatter_first_dim", f"{MAPPINGS}:_reduce_scatter_along_first_dim",
       lambda o: reduce_scatter_along_first_dim,
       "sequence parallel reduce-scatters row-parallel outputs along the token dimension",
       "torch.empty(..., device=torch.cuda.current_device()) in _reduce_scatter_along_first_dim"),
    Patch(name="all_to_all_split_sizes", targets=(f"{MAPPINGS}:_AllToAll.forward",),
          replacement=lambda o: staticmethod(all_to_all_forward),
          why="expert-parallel token exchange; gloo rejects tensor split sizes and there is no CUDA device",
          replaces="tensor/numpy split sizes and the torch.cuda.current_device() output in _AllToAll.forward",
          versions=MEGATRON_VERSIONS,
          remove_when="megatron-core converts split sizes to lists and allocates on the input's device"),
    _p("linear_sequence_parallel_backward",
       f"{LAYERS}:LinearWithGradAccumulationAndAsyncCommunication.backward", make_linear_backward,
       "column/row-parallel linears with sequence parallel (tensor parallel > 1) in backward",
       "torch.empty(..., device=torch.cuda.current_device()) for the reduce-scattered input grad"),
]
