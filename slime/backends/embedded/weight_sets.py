"""Engine weights that live in two shared weight sets the trainer writes directly (one copy per byte).

The colocated sync through shared buckets copies every byte twice: the trainer's export into a
shared buffer, then this engine out of it into its weights. With weight sets the engine's weights
themselves live in shared memory the trainer maps: two flat uint8 buffers of the same layout (every
weight tensor of the model at a fixed, 64-byte aligned place), allocated by the trainer and attached
here once. Per weight tensor one set is live (the engine's tensor is a view of it) and the other is
the target of the next update. An update is:

  1. `begin`: the current epoch and, per tensor, its target set (never the live one);
  2. the trainer copies every exported tensor into its place in the target set (the engine reads only
     live sets, so generation could even go on);
  3. `commit(names, ...)`: checked in full (epoch, names, optional checksums of the target bytes) before
     anything changes; then, under the model lock, every touched tensor switches to its target view
     and that set becomes live; the old set is the next update's target. A refused or never committed
     update leaves every weight as it was (all or nothing by construction).

A tensor an update covers only in part (some experts of a fused expert tensor) gets its other parts
copied from the live weights into the target before the switch.

Layouts ("expert_layout"): "hf" keeps every tensor in its runtime (transformers) layout; "in_out"
stores the fused 3-D expert tensors (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) as the trainer
does, `[E, H, 2I]` / `[E, I, H]`, with the engine's parameter a transposed view of it: the trainer's
exported expert weights (transposed views of its layout) then copy as contiguous rows instead of
through a transpose. The forward computes the same products from the transposed view (x @ W.T reads
W.T contiguous); the float rounding of a matmul may differ with the layout (same as any kernel
change), not the math.

Other updates (named tensors, disk, distributed) copy into the live views in place, so the live set
always holds the engine's weights; the target's contents do not matter until the trainer writes it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.backends.embedded.errors import BadRequest
from slime.backends.embedded.weights import WeightNameMap, dtype_name

ALIGN = 64
LAYOUTS = ("hf", "in_out")


@dataclass
class _Region:
    """One runtime tensor (parameter or buffer) of the model and its place in a set."""

    owners: list[tuple[torch.nn.Module, str]]  # (module, attribute) holding it; tied weights: one per holder
    shape: tuple[int, ...]  # runtime shape
    dtype: torch.dtype
    start: int  # bytes into a set
    transposed: bool  # stored with its last two dims swapped (the "in_out" expert layout)
    parts: dict[tuple, tuple] = field(default_factory=dict)  # slot key -> index, of a fused tensor's named parts

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor (runtime shape) inside the uint8 set buffer `flat`."""
        raw = flat[self.start:self.start + self.nbytes].view(self.dtype)
        if not self.transposed:
            return raw.view(self.shape)
        *lead, a, b = self.shape
        return raw.view(*lead, b, a).transpose(-1, -2)

    def live(self) -> torch.Tensor:
        module, attr = self.owners[0]
        return getattr(module, attr)

    def switch_to(self, view: torch.Tensor) -> None:
        for module, attr in self.owners:
            if attr in module._parameters:
                module._parameters[attr].data = view
            else:
                module._buffers[attr] = view


def _key(index: tuple) -> tuple:
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else int(i) for i in index)


class WeightSets:
    """The engine's side of the weight-set protocol (see module docstring). Not thread-safe by itself: the
    engine calls it under its model lock where weights change."""

    def __init__(self, name_map: WeightNameMap, expert_layout: str) -> None:
        if expert_layout not in LAYOUTS:
            raise BadRequest(f"expert_layout {expert_layout!r} is not supported; use one of {list(LAYOUTS)}")
        self.expert_layout = expert_layout
        self.regions: list[_Region] = []
        self.names: dict[str, tuple[int, tuple]] = {}  # name -> (region, index into the runtime tensor)
        by_tensor: dict[int, int] = {}
        offset = 0
        for name, slot in name_map._slots.items():
            t = name_map._tensor(slot.runtime_name)
            module_path, _, attr = slot.runtime_name.rpartition(".")
            owner = (name_map.model.get_submodule(module_path), attr)
            r = by_tensor.get(id(t))
            if r is None:
                fused = slot.runtime_name in name_map._fused
                region = _Region([owner], tuple(t.shape), t.dtype, offset,
                                 transposed=expert_layout == "in_out" and fused and t.dim() == 3)
                offset += -(-region.nbytes // ALIGN) * ALIGN
                r = by_tensor[id(t)] = len(self.regions)
                self.regions.append(region)
            elif owner not in self.regions[r].owners:
                self.regions[r].owners.append(owner)
            if slot.index:
                self.regions[r].parts[_key(slot.index)] = slot.index
            self.names[name] = (r, slot.index)
        self.set_bytes = max(offset, ALIGN)
        # A fused tensor whose named parts do not tile it exactly is written only by whole-tensor names.
        for region in self.regions:
            if region.parts and sum(_numel(region.shape, ix) for ix in region.parts.values()) != math.prod(region.shape):
                region.parts = {}
        self.names = {n: (r, ix) for n, (r, ix) in self.names.items() if not ix or self.regions[r].parts}
        # The same model and layout give the same id (after a release and resume the trainer's sets fit again).
        desc = repr((expert_layout, sorted(self.names), [(g.shape, str(g.dtype), g.start, g.transposed)
                                                         for g in self.regions]))
        self.layout_id = hashlib.sha256(desc.encode()).hexdigest()[:16]
        self.sets: list[torch.Tensor] | None = None
        self.live: list[int | None] = [None] * len(self.regions)  # set holding each tensor; None: the engine's own
        self.epoch = 0

    # ------------------------------------------------------------------ protocol
    def layout(self) -> dict[str, Any]:
        """Where every weight (HF/runtime name) lives in a set: [region, byte offset, shape, stride, dtype]."""
        meta = torch.empty(self.set_bytes, dtype=torch.uint8, device="meta")
        tensors = {}
        for name, (r, index) in self.names.items():
            v = self.regions[r].view(meta)
            v = v[index] if index else v
            tensors[name] = [r, v.storage_offset() * v.element_size(), list(v.shape), list(v.stride()),
                             dtype_name(v.dtype)]
        return {"layout_id": self.layout_id, "set_bytes": self.set_bytes, "sets": 2,
                "expert_layout": self.expert_layout, "tensors": tensors}

    def attach(self, sets: list[torch.Tensor]) -> None:
        if len(sets) != 2 or not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1
                                     for s in sets):
            raise BadRequest("attach_weight_sets needs exactly two 1-D uint8 tensors")
        small = [s.numel() for s in sets if s.numel() < self.set_bytes]
        if small:
            raise BadRequest(f"weight set of {small[0]} bytes is smaller than the layout's {self.set_bytes}")
        if sets[0].untyped_storage().data_ptr() == sets[1].untyped_storage().data_ptr():
            raise BadRequest("the two weight sets must be distinct buffers")
        self.sets = list(sets)
        self.live = [None] * len(self.regions)
        self.epoch += 1

    def detach(self) -> None:
        """Stop using the sets (the engine releases its weights): buffers that live in a set get their own
        copy, so nothing of the engine reads memory the trainer may write next."""
        if self.sets is not None:
            for r, region in enumerate(self.regions):
                if self.live[r] is not None and any(attr not in m._parameters for m, attr in region.owners):
                    region.switch_to(region.live().clone())
        self.sets = None
        self.live = [None] * len(self.regions)
        self.epoch += 1

    def targets(self) -> list[int]:
        return [0 if live is None else 1 - live for live in self.live]

    def state(self) -> dict[str, Any]:
        return {"attached": self.sets is not None, "layout_id": self.layout_id, "epoch": self.epoch,
                "targets": self.targets()}

    def prepare(self, names: Any, epoch: Any) -> tuple[list[str], list[int]]:
        """Check a commit (nothing changes); returns the names and the touched regions. Parts of a touched
        fused tensor that the update lacks are copied from the live weights into the target here."""
        if self.sets is None:
            raise BadRequest("no weight sets attached; call /attach_weight_sets first")
        if epoch != self.epoch:
            raise BadRequest(f"weight sets changed since this update began (epoch {epoch!r}, now {self.epoch}); "
                             "nothing changed")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise BadRequest("names must be a non-empty list of weight names")
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise BadRequest(f"weight update rejected, nothing changed: unknown weights {unknown[:3]}")
        if len(set(names)) != len(names):
            raise BadRequest("weight update rejected, nothing changed: a weight appears twice")
        covered: dict[int, set] = {}
        whole: set[int] = set()
        for n in names:
            r, index = self.names[n]
            if index:
                covered.setdefault(r, set()).add(_key(index))
            else:
                whole.add(r)
        touched = sorted(whole | covered.keys())
        targets = self.targets()
        with torch.no_grad():
            for r in touched:
                region = self.regions[r]
                if r in whole or covered[r] == region.parts.keys():
                    continue
                live, target = region.live(), region.view(self.sets[targets[r]])
                for key, index in region.parts.items():
                    if key not in covered[r]:
                        target[index].copy_(live[index])
        return names, touched

    def target_views(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        targets = self.targets()
        out = []
        for n in names:
            r, index = self.names[n]
            v = self.regions[r].view(self.sets[targets[r]])
            out.append((n, v[index] if index else v))
        return out

    def switch(self, touched: list[int]) -> None:
        """Make the targets of `touched` live (call under the model lock, after `prepare`)."""
        targets = self.targets()
        for r in touched:
            self.regions[r].switch_to(self.regions[r].view(self.sets[targets[r]]))
            self.live[r] = targets[r]
        self.epoch += 1


def _numel(shape: tuple[int, ...], index: tuple) -> int:
    return math.prod(torch.empty(shape, device="meta")[index].shape)
