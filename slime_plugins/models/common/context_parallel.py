"""Context parallel (CP) for packed THD micro-batches, with Megatron's causal load balancing.

Every sequence of a pack (its length a multiple of 2*CP) is cut into 2*CP equal chunks; CP rank r keeps
chunks r and 2*CP-1-r, so every rank gets the same share of the causal attention work. The local tokens
are these chunks in sequence order (for each sequence: chunk r, then chunk 2*CP-1-r).

Attention treats every local chunk as its own query segment whose key segment is its sequence from the
start up to the chunk's end: the ops' `cu_seqlens_q` / `cu_seqlens_k` with bottom-right-aligned causal
masking then give each query exactly its causal prefix, and key positions inside a key segment are
positions within the sequence (what DSA top-k indices count). Keys come from the whole sequence: the
layer all-gathers a small per-token tensor (MLA's compressed latent + rope key, the DSA indexer key)
over the CP group (`gather_sequence`: all-gather forward, reduce-scatter of the grad backward), and picks
each key segment's rows out of the gathered sequence (`key_rows`). The device attention kernels (varlen flash,
the NPU's TND fusion attention) take monotone key offsets only, so the shorter prefix of a sequence's two
chunks is copied once more: (2*CP + 1) / (2*CP) of the sequence's keys per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclass
class ContextParallelLayout:
    """Where one CP rank's tokens sit in a packed micro-batch, and the segments its attention uses."""

    size: int
    rank: int
    group: Any  # the CP process group (megatron's get_context_parallel_group())
    local_index: torch.Tensor  # int64 [T / CP]: packed row of each local token, local order
    cu_seqlens_q: torch.Tensor  # int32: one query segment per local chunk (leading 0)
    cu_seqlens_kv: torch.Tensor  # int32: the key segment of each query segment (leading 0)
    kv_index: torch.Tensor  # int64: packed rows forming the key segments (index into the gathered sequence)
    gather_order: torch.Tensor  # int64 [T]: row of the rank-major all-gather that holds packed row p

    @property
    def num_tokens(self) -> int:
        return int(self.gather_order.numel())

    def to(self, device) -> "ContextParallelLayout":
        move = {n: getattr(self, n).to(device) for n in ("local_index", "cu_seqlens_q", "cu_seqlens_kv", "kv_index",
                                                         "gather_order")}
        return ContextParallelLayout(self.size, self.rank, self.group, **move)


def _chunks(cu_seqlens: Sequence[int], size: int, rank: int) -> list[tuple[int, int, int]]:
    """(sequence start, chunk start, chunk end) of rank `rank`'s chunks, in local order."""
    out = []
    for b, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        n = end - start
        if n % (2 * size):
            raise ValueError(f"context parallel {size}: sequence {b} of the pack has {n} tokens, not a multiple of "
                             f"2*CP={2 * size}; pad every sequence to a multiple of 2*CP (data.pack(cp_size=...))")
        if n == 0:
            continue
        chunk = n // (2 * size)
        for j in (rank, 2 * size - 1 - rank):
            out.append((start, start + j * chunk, start + (j + 1) * chunk))
    return out


def build_layout(cu_seqlens: torch.Tensor | Sequence[int], size: int, rank: int, group: Any = None
                 ) -> ContextParallelLayout:
    """The layout of CP rank `rank` of `size` for a pack with (global) sequence boundaries `cu_seqlens`."""
    cu = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not 0 <= rank < size:
        raise ValueError(f"CP rank {rank} is not in [0, {size})")

    def ranges(spans) -> torch.Tensor:
        parts = [torch.arange(a, b, dtype=torch.long) for a, b in spans]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    per_rank = [_chunks(cu, size, r) for r in range(size)]
    mine = per_rank[rank]
    rank_major = torch.cat([ranges((a, b) for _, a, b in chunks) for chunks in per_rank])
    gather_order = torch.empty_like(rank_major)
    gather_order[rank_major] = torch.arange(rank_major.numel())

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)

    return ContextParallelLayout(
        size=size, rank=rank, group=group, local_index=ranges((a, b) for _, a, b in mine),
        cu_seqlens_q=offsets([b - a for _, a, b in mine]), cu_seqlens_kv=offsets([b - s for s, _, b in mine]),
        kv_index=ranges((s, b) for s, _, b in mine), gather_order=gather_order)


def gather_sequence(x: torch.Tensor, layout: ContextParallelLayout) -> torch.Tensor:
    """This rank's tokens [T / CP, ...] -> the whole pack [T, ...] in sequence order, from every CP rank.
    With grad: megatron's all-gather whose backward reduce-scatters (sums) the grads back to their owners."""
    from megatron.core import tensor_parallel

    if torch.is_grad_enabled() and x.requires_grad:
        gathered = tensor_parallel.gather_from_sequence_parallel_region(x, True, group=layout.group)
    else:
        parts = [torch.empty_like(x) for _ in range(layout.size)]
        dist.all_gather(parts, x.contiguous(), group=layout.group)
        gathered = torch.cat(parts, dim=0)
    return gathered.index_select(0, layout.gather_order)


def key_rows(x_sequence: torch.Tensor, layout: ContextParallelLayout) -> torch.Tensor:
    """Rows of the gathered pack [T, ...] that form the key segments (layout.cu_seqlens_kv)."""
    return x_sequence.index_select(0, layout.kv_index)


class _SumOverContextParallel(torch.autograd.Function):
    """Forward: all-reduce (sum) over the CP group of per-token values each rank filled for its own tokens
    (zeros elsewhere). Backward: identity, since every CP rank then computes the same loss from the same
    values, and each rank's grad reaches only its own tokens (through the scatter before this)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def combine_rows(local_values: torch.Tensor, slots: torch.Tensor, total: int, group) -> torch.Tensor:
    """Per-row values this rank computed for rows `slots` of a `total`-row vector -> the whole vector on every
    CP rank (sums with zeros: exact). Differentiable."""
    full = local_values.new_zeros(total, *local_values.shape[1:]).index_copy(0, slots.to(local_values.device),
                                                                             local_values)
    return _SumOverContextParallel.apply(full, group)
