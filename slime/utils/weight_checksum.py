"""Cheap weight checksums, computed the same way by the trainer (on exported HF tensors) and by a
rollout engine (on its loaded weights), to verify a weight sync.

Per tensor: (sum of x_i * w_i, sum of |x_i| * w_i) in float64 with position weights
w_i = 1 + (i mod 251) / 251, so swapped, shifted or transposed elements change the sum, not only
changed values. Compare with a tolerance relative to the abs-sum: the two sides may reduce in a
different order.
"""

from __future__ import annotations

from typing import Iterable

import torch

_PERIOD = 251  # prime, so the weight pattern does not align with power-of-two row lengths
REL_TOL = 1e-9


def tensor_checksum(t: torch.Tensor) -> list[float]:
    x = t.detach().reshape(-1).to(torch.float64)
    w = 1.0 + (torch.arange(x.numel(), device=x.device) % _PERIOD).to(torch.float64) / _PERIOD
    return [float((x * w).sum()), float((x.abs() * w).sum())]


def named_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[float]]:
    return {name: tensor_checksum(t) for name, t in named}


def mismatches(expected: dict[str, list[float]], actual: dict[str, list[float]], rel_tol: float = REL_TOL) -> list[str]:
    """Names whose checksums differ (or that one side lacks), sorted; empty when the weights agree."""
    bad = [n for n in expected if n not in actual] + [n for n in actual if n not in expected]
    for name in expected.keys() & actual.keys():
        (s1, a1), (s2, a2) = expected[name], actual[name]
        if abs(s1 - s2) > rel_tol * (max(a1, a2) + 1.0) or abs(a1 - a2) > rel_tol * (max(a1, a2) + 1.0):
            bad.append(name)
    return sorted(bad)
