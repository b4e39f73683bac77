"""Ascend NPU SIMULATION for tests (not hardware).

- `torch_npu/`: a fake torch_npu package that follows the documented op contracts (see its docstring).
- `slime_npu_sim.py`: accelerator plugin registering `SimulatedAscendAccelerator` as "npu" in any process
  (PYTHONPATH=tests/npu_sim SLIME_ACCELERATOR_PLUGINS=slime_npu_sim SLIME_ACCELERATOR=npu).
- `activate()`: in-process context manager used by the tests' `accel` fixture.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from npu_sim import torch_npu as fake_torch_npu
from npu_sim.slime_npu_sim import SimulatedAscendAccelerator

__all__ = ["SimulatedAscendAccelerator", "activate", "fake_torch_npu", "forget_probes"]


def forget_probes() -> None:
    """Drop slime's once-per-process op probe results and SoC (another simulated release/SoC follows)."""
    from slime.accelerator.ascend import ops

    ops.forget_probes()


@contextlib.contextmanager
def activate(release: str | None = None, soc: str | None = None) -> Iterator[SimulatedAscendAccelerator]:
    """Install the simulator as `torch_npu` (and torch.npu) and yield a SimulatedAscendAccelerator;
    `release` simulates an older Ascend PyTorch release (e.g. "7.2.0"), `soc` another SoC (e.g. "950PR";
    default A3). Everything is restored on exit, and slime's per-process op probes are forgotten."""
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = fake_torch_npu
    fake_torch_npu.install_runtime()
    fake_torch_npu.simulate_release(release)
    fake_torch_npu.simulate_soc(soc)
    forget_probes()
    try:
        yield SimulatedAscendAccelerator()
    finally:
        forget_probes()
        fake_torch_npu.simulate_soc(None)
        fake_torch_npu.simulate_release(None)
        fake_torch_npu.uninstall_runtime()
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
