"""Megatron's tensor-parallel parameter attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`) on every TP shard of a slime model.

megatron-core sets them only while it initialises weights (`config.perform_initialization`); slime builds
without initialisation (the weights come from the checkpoint), so the build marks the shards here.
Megatron's grad norm and grad clipping count a parameter without `tensor_model_parallel=True` on TP rank 0
only (it takes it for a replica): an unmarked shard drops the other ranks' shards from the norm.
Replicated parameters (norms, router, MLA down-projections, indexer) stay unmarked.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)

from slime_plugins.models.common.layers import SwiGLUMLP


def mark_tensor_parallel(param: torch.nn.Parameter | None, partition_dim: int, stride: int = 1) -> None:
    """Mark `param` as a TP shard split on `partition_dim` (stride 2: [gate; up] halves split separately).
    Left alone when megatron's own initialisation already marked it."""
    if param is None or hasattr(param, "tensor_model_parallel"):
        return
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=partition_dim, stride=stride)


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Mark the weights of every megatron parallel layer in `model` (vocab-parallel tables and column-
    parallel weights on dim 0, row-parallel weights on dim 1; a row-parallel bias is replicated)."""
    gate_up = {id(m.linear_fc1.weight) for m in model.modules() if isinstance(m, SwiGLUMLP)}
    for module in model.modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            mark_tensor_parallel(module.weight, 0, 2 if id(module.weight) in gate_up else 1)
            mark_tensor_parallel(getattr(module, "bias", None), 0)
        elif isinstance(module, RowParallelLinear):
            mark_tensor_parallel(module.weight, 1)
