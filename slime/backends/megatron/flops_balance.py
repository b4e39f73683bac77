"""--balance-by-flops (upstream's): micro-batches balanced by forward FLOPs instead of packed to the token
budget. A sequence of L tokens costs coeff * L + L^2: the linear layers grow with L, causal attention with
L^2 / 2 query-key pairs. With h the hidden size and f the per-token MLP width (the routed experts' top-k
width plus shared experts for MoE), one layer's linear FLOPs per token are ~2 (4 h^2 + 3 h f) (projections,
gated MLP) and its attention FLOPs per key-query pair ~4 h, so coeff = (4 h^2 + 3 h f) / h = 4 h + 3 f.
The micro-batch count is that of the token budget (ceil(tokens / budget), equal over data-parallel ranks);
the samples are split into that many bins by the Karmarkar-Karp largest-differencing method, which may put
more than the budget's tokens in a bin."""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def flops_coefficient(arch) -> float:
    h = int(arch.hidden_size)
    experts = int(getattr(arch, "num_experts_per_tok", 0) or 0)
    if experts and getattr(arch, "moe_intermediate_size", None):
        f = experts * int(arch.moe_intermediate_size) + int(getattr(arch, "n_shared_experts", 0) or 0) * int(
            arch.moe_intermediate_size)
    else:
        f = int(getattr(arch, "intermediate_size", 4 * h))
    return 4.0 * h + 3.0 * f


def workloads(lengths: Sequence[int], coeff: float) -> list[float]:
    return [coeff * n + float(n) * n for n in lengths]


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """k bins of the positions of `costs` (each once, every bin non-empty when len(costs) >= k) with nearly
    equal sums: repeatedly merge the two partial partitions whose spreads are largest, pairing the heaviest
    bins of one with the lightest of the other."""
    if k < 1:
        raise ValueError(f"need at least one bin, got {k}")
    if len(costs) < k:
        raise ValueError(f"cannot split {len(costs)} samples into {k} non-empty micro-batches")
    # a partition: (-spread, tie, bins sorted heaviest first as (sum, members))
    heap = []
    for i, c in enumerate(costs):
        bins = [(float(c), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), i, bins))
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ma + mb) for (sa, ma), (sb, mb) in zip(a, reversed(b))]
        merged.sort(key=lambda x: -x[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(members) for _, members in heap[0][2]]


def flops_balanced_micro_batches(lengths: Sequence[int], max_tokens: int, coeff: float,
                                 min_count: int = 1) -> list[list[int]]:
    """Bins (positions into `lengths`) for one rank's share of a step: max(ceil(tokens / max_tokens),
    min_count) of them, balanced by workload."""
    count = max(min_count, micro_batch_count(lengths, max_tokens))
    if count >= len(lengths):
        return [[i] for i in range(len(lengths))]
    return karmarkar_karp(workloads(lengths, coeff), count)


def micro_batch_count(lengths: Sequence[int], max_tokens: int) -> int:
    return min(len(lengths), max(1, math.ceil(sum(lengths) / max_tokens)))
