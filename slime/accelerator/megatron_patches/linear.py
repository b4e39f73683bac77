"""Fast paths of megatron's tensor-parallel linear layers where they communicate nothing.

megatron-core runs every ColumnParallelLinear / RowParallelLinear through Python autograd Functions:
`LinearWithGradAccumulationAndAsyncCommunication` (the matmul, with its own Python backward) and the
identity mappings `_CopyToModelParallelRegion` / `_ReduceFromModelParallelRegion` around it. With one
tensor-parallel rank, no sequence parallel, no gradient-accumulation fusion and no async input-grad
all-reduce these do no communication at all: the Function is `input @ weight.t() (+ bias)` with the
textbook backward, the mappings are identities. Each still costs a Python Function call in forward
and a Python node in backward (about 40 of each per step of the tiny GLM-5 model). The replacements
run the same torch ops without the Python autograd machinery: forward `torch.matmul(input,
weight.t())` (+ bias), as the Function's forward does; backward by autograd, which computes the input
grad as `grad @ weight` and the weight grad as `grad.t() @ input` on the 2-D folded tensors, the same
matmuls as the Function's backward (tests/test_linear_fast_path.py checks the grads bitwise). Every
other case (sequence parallel, all-reduced input grads, fused wgrad accumulation, deferred embedding
wgrad, autocast, a TP group of more than one rank for the mappings) goes to megatron's original.
"""

from __future__ import annotations

import torch

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch

LAYERS = "megatron.core.tensor_parallel.layers"
MAPPINGS = "megatron.core.tensor_parallel.mappings"


def _group_if_none(group):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    return get_tensor_model_parallel_group_if_none(group)


def make_linear(original):
    """linear_with_grad_accumulation_and_async_allreduce: plain matmul when nothing is communicated."""

    def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                          allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                          wgrad_deferral_limit=0, async_grad_allreduce=None,
                                                          tp_group=None):
        if (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None
                or async_grad_allreduce is not None or torch.is_autocast_enabled(input.device.type)):
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        output = torch.matmul(input, weight.t())
        return output if bias is None else output + bias

    # The original reads and sets this attribute through its module-global name, which now names this function.
    linear_with_grad_accumulation_and_async_allreduce.warned = getattr(original, "warned", False)
    return linear_with_grad_accumulation_and_async_allreduce


def make_identity_mapping(original):
    """copy_to / reduce_from_tensor_model_parallel_region: the input itself on a one-rank TP group (forward
    and backward are identities there: megatron's _reduce returns its input when group.size() == 1)."""

    def mapping(input_, group=None):
        group = _group_if_none(group)
        if group is not None and group.size() == 1:
            return input_
        return original(input_, group=group)

    mapping.__name__ = mapping.__qualname__ = original.__name__
    mapping.__doc__ = original.__doc__
    return mapping


def _p(name, target, replacement, why, replaces):
    return Patch(name=name, targets=(target,), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS,
                 remove_when="megatron-core skips its Python autograd Functions when a linear communicates nothing "
                             "(or the CPU trainer moves to a linear layer that does)")


PATCHES = [
    _p("linear_without_communication", f"{LAYERS}:linear_with_grad_accumulation_and_async_allreduce", make_linear,
       "every column/row-parallel linear at TP=1 (no sequence parallel, no fused wgrad accumulation) runs a Python "
       "autograd Function whose forward and backward are plain matmuls",
       "LinearWithGradAccumulationAndAsyncCommunication.apply (a Python forward and backward per linear per step)"),
    _p("tp_copy_identity_one_rank", f"{MAPPINGS}:copy_to_tensor_model_parallel_region", make_identity_mapping,
       "ColumnParallelLinear wraps its input in an identity Function even when the TP group has one rank",
       "_CopyToModelParallelRegion.apply (identity forward, _reduce = identity backward at one rank)"),
    _p("tp_reduce_identity_one_rank", f"{MAPPINGS}:reduce_from_tensor_model_parallel_region", make_identity_mapping,
       "RowParallelLinear wraps its output in an identity Function even when the TP group has one rank",
       "_ReduceFromModelParallelRegion.apply (_reduce = identity forward, identity backward at one rank)"),
]
