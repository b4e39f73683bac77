"""Ascend NPU SIMULATION for tests (not hardware).

- `torch_npu/`: a fake torch_npu package that follows the documented op contracts (see its docstring).
- `slime_npu_sim.py`: accelerator plugin registering `SimulatedAscendAccelerator` as "npu" in any process
  (PYTHONPATH=tests/npu_sim SLIME_ACCELERATOR_PLUGINS=slime_npu_sim SLIME_ACCELERATOR=npu).
- `sgl_kernel_npu/`: a fake sgl_kernel_npu (the KDA gate and causal conv kernels, their documented contracts).
- `activate()`: in-process context manager used by the tests' `accel` fixture.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from npu_sim import sgl_kernel_npu as fake_sgl_kernel_npu
from npu_sim import torch_npu as fake_torch_npu
from npu_sim.sgl_kernel_npu import fla as _fake_fla
from npu_sim.sgl_kernel_npu.fla import kda_gate as _fake_kda_gate
from npu_sim.slime_npu_sim import SimulatedAscendAccelerator

__all__ = ["SimulatedAscendAccelerator", "activate", "fake_sgl_kernel_npu", "fake_torch_npu", "forget_probes"]


def forget_probes() -> None:
    """Drop slime's once-per-process op probe results and SoC (another simulated release/SoC follows)."""
    from slime.accelerator.ascend import fp8_ops, ops

    ops.forget_probes()
    fp8_ops.forget_probes()


_PROBE_CACHE: dict[tuple, tuple] = {}
# An image with sgl-kernel-npu (the KDA gate and causal conv kernels): installed under its own names while active.
_SGL_MODULES = {"sgl_kernel_npu": fake_sgl_kernel_npu, "sgl_kernel_npu.fla": _fake_fla,
                "sgl_kernel_npu.fla.kda_gate": _fake_kda_gate}


@contextlib.contextmanager
def activate(release: str | None = None, soc: str | None = None, defects: tuple[str, ...] = (),
             reuse_probes: bool = False) -> Iterator[SimulatedAscendAccelerator]:
    """Install the simulator as `torch_npu` (and torch.npu) and yield a SimulatedAscendAccelerator;
    `release` simulates an older Ascend PyTorch release (e.g. "7.2.0"), `soc` another SoC (e.g. "950PR";
    default A3), `defects` finite-but-wrong kernels (torch_npu.simulate_defects). Everything is restored on
    exit, and slime's per-process op probes are forgotten. `reuse_probes`: start from the probe results an
    earlier reuse_probes activation with the same release, SoC and defects left (the probes are
    deterministic; tests that patch kernels must not reuse)."""
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = fake_torch_npu
    previous_sgl = {name: sys.modules.get(name) for name in _SGL_MODULES}
    sys.modules.update(_SGL_MODULES)
    fake_torch_npu.install_runtime()
    fake_torch_npu.simulate_release(release)
    fake_torch_npu.simulate_soc(soc)
    fake_torch_npu.simulate_defects(*defects)
    forget_probes()
    key = (release, soc, tuple(defects))
    if reuse_probes and key in _PROBE_CACHE:
        from slime.accelerator.ascend import ops

        ops.restore_probe_results(_PROBE_CACHE[key])
    try:
        yield SimulatedAscendAccelerator()
    finally:
        if reuse_probes:
            from slime.accelerator.ascend import ops

            _PROBE_CACHE[key] = ops.probe_results()
        forget_probes()
        fake_torch_npu.simulate_defects()
        fake_torch_npu.simulate_soc(None)
        fake_torch_npu.simulate_release(None)
        fake_torch_npu.uninstall_runtime()
        for name, module in previous_sgl.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
