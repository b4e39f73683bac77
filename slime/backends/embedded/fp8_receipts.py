"""What the embedded engine answers in /get_weights_checksum for a weight it received as a block-FP8 pair.

A sender that serves an FP8 engine (factory.in_checkpoint_format, fp8_blocks.quantize_named) checksums what it
sends: `X.weight` in e4m3 and `X.weight_scale_inv` (slime.utils.weight_checksum, on every transport: tensor
handles, a collective group, a checkpoint on disk). This engine dequantizes the pair into its high-precision
`X.weight` and keeps no scale, so the read-back after a sync (--check-weight-sync) could neither name the scale
nor match the weight's bytes. So every commit that folds a pair keeps a receipt per weight: the checksums of
the e4m3 weight and of the scale as received, and the checksum of the weight it committed. The read-back
answers the received checksums while the weight still holds exactly what was committed (checked on the live
bytes at every read-back), so it verifies the sender's bytes and the engine's weight together.

A receipt is computed before its commit's first copy (a failure changes nothing, receipts included) and
replaces the old ones in the same commit; any later commit of the weight in high precision drops it, as does
releasing the weights. A weight whose bytes changed by any other route (an alias name, weight sets) answers its
live checksum and its scale is refused: the engine no longer holds what that pair dequantizes to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from slime.backends.embedded.errors import BadRequest


@dataclass(frozen=True)
class Fp8Receipt:
    scale_name: str
    weight_sum: list[int]  # the e4m3 weight as received
    scale_sum: list[int]  # its weight_scale_inv as received
    held_sum: list[int]  # the dequantized weight as committed, in the model's dtype


def mark_received(plan: Iterable[Any], pairs: dict[str, tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Note on each planned copy of a weight in `pairs` ({weight: (scale name, e4m3 weight, scale)}, as received)
    the checksums of the pair (PlannedCopy.fp8_received), before its source becomes their dequantization."""
    from slime.utils import weight_checksum

    items = [p for p in plan if p.name in pairs]
    if not items:
        return
    weights = weight_checksum.named_checksums((p.name, pairs[p.name][1]) for p in items)
    scales = weight_checksum.named_checksums((p.name, pairs[p.name][2]) for p in items)
    for p in items:
        p.fp8_received = (pairs[p.name][0], weights[p.name], scales[p.name])


def stage_receipts(plan: Iterable[Any]) -> dict[str, Fp8Receipt]:
    """{weight: its receipt} of every planned copy made from an FP8 pair (marked by mark_received), with the
    checksum of its source as it will land; called before the copies."""
    from slime.utils import weight_checksum

    folded = [p for p in plan if p.fp8_received is not None]
    if not folded:
        return {}
    held = weight_checksum.named_checksums((p.name, p.source.to(p.target.dtype)) for p in folded)
    return {p.name: Fp8Receipt(*p.fp8_received, held[p.name]) for p in folded}


def received_checksums(receipts: dict[str, Fp8Receipt]) -> dict[str, list[int]]:
    """The sender's view of the staged pairs: {X.weight: e4m3 checksum, X.weight_scale_inv: scale checksum}."""
    out = {}
    for name, r in receipts.items():
        out[name], out[r.scale_name] = r.weight_sum, r.scale_sum
    return out


class Fp8Receipts:
    """The engine's receipts (read and changed under its model lock)."""

    def __init__(self) -> None:
        self._by_weight: dict[str, Fp8Receipt] = {}
        self._weight_of_scale: dict[str, str] = {}

    def commit(self, committed: Iterable[str], staged: dict[str, Fp8Receipt]) -> None:
        """After a commit of the weights `committed`: theirs are `staged` (none for a high-precision copy)."""
        self.drop(committed)
        for name, r in staged.items():
            self._by_weight[name] = r
            self._weight_of_scale[r.scale_name] = name

    def drop(self, names: Iterable[str]) -> None:
        for name in names:
            r = self._by_weight.pop(name, None)
            if r is not None:
                self._weight_of_scale.pop(r.scale_name, None)

    def clear(self) -> None:
        self._by_weight.clear()
        self._weight_of_scale.clear()

    def weight_of(self, scale_name: str) -> str | None:
        return self._weight_of_scale.get(scale_name)

    def answer(self, names: list[str], live: Callable[[list[str]], dict[str, list[int]]]) -> dict[str, list[int]]:
        """{name: checksum} for `names` (model weights and the scales of received pairs); `live(weights)`
        checksums the engine's weights as they are. A scale whose weight no longer holds its dequantization is
        a BadRequest naming it."""
        weights = [n for n in names if self.weight_of(n) is None]
        paired = sorted({n for n in weights if n in self._by_weight} | {self._weight_of_scale[n] for n in names
                                                                        if n not in weights})
        sums = live(sorted(set(weights) | set(paired)))
        for name in paired:
            if sums[name] == self._by_weight[name].held_sum:
                sums[name] = self._by_weight[name].weight_sum
                sums[self._by_weight[name].scale_name] = self._by_weight[name].scale_sum
            else:
                stale = self._by_weight[name].scale_name
                self.drop([name])
                if stale in names:
                    raise BadRequest(f"{stale}: {name} changed since that block-FP8 pair was received, so this "
                                     f"engine holds no weight it scales; ask for {name} alone")
        return {n: sums[n] for n in names}
