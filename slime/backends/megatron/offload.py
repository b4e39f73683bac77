"""--offload-train: free the trainer's device memory while the engines generate (colocated).

Every storage behind the model's parameters, Megatron's grad buffers and the optimizer's state is
copied to host memory and then resized to zero bytes in place; onload resizes it back and copies
the data in. Resizing the storage (not replacing tensors) keeps every view valid: parameters,
`main_grad` views into the grad buffer, and the optimizer's references all see the restored memory.
Grad buffers are not copied (they are zeroed at the start of each step anyway).
"""

from __future__ import annotations

from typing import Iterable

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in getattr(torch_opt, "state", {}).values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in getattr(torch_opt, "param_groups", []):
            out.extend(group["params"])  # fp32 main params of mixed-precision optimizers
    return out


def _grad_buffers(model) -> list[torch.Tensor]:
    buffers = list(getattr(model, "buffers", []) or []) + list(getattr(model, "expert_parallel_buffers", []) or [])
    return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]


class Offloader:
    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage | None, int]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Returns the bytes released."""
        if self._saved:
            return 0
        grad = _storages(_grad_buffers(self.model))
        grad_ptrs = {s.data_ptr() for s in grad}
        keep = [s for s in _storages(list(self.model.parameters()) + _optimizer_tensors(self.optimizer))
                if s.data_ptr() not in grad_ptrs]
        released = 0
        for s in keep:
            host = torch.empty(s.nbytes(), dtype=torch.uint8, device="cpu")
            host.untyped_storage().copy_(s)
            self._saved.append((s, host.untyped_storage(), s.nbytes()))
        for s in grad:
            self._saved.append((s, None, s.nbytes()))
        for s, _, n in self._saved:
            s.resize_(0)
            released += n
        return released

    def onload(self) -> None:
        for s, host, n in self._saved:
            s.resize_(n)
            if host is None:
                torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).zero_()
            else:
                s.copy_(host)
        self._saved = []
