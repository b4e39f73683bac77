"""slime.accelerator: the one place that knows which device slime runs on.

    from slime.accelerator import get_accelerator
    acc = get_accelerator()          # cpu | cuda | npu, auto-detected (SLIME_ACCELERATOR overrides)
    x = torch.zeros(4, device=acc.device())
    y = acc.ops.rms_norm(x, w, 1e-6)
"""

from slime.accelerator.ascend import AscendAccelerator
from slime.accelerator.base import (
    MEMORY_STAT_KEYS,
    Accelerator,
    AcceleratorUnavailable,
    Capabilities,
    DeviceConfigError,
    NullEvent,
    NullStream,
)
from slime.accelerator.cpu import CpuAccelerator
from slime.accelerator.cuda import CudaAccelerator
from slime.accelerator.registry import (
    accelerator_class,
    accelerator_names,
    get_accelerator,
    register_accelerator,
    set_accelerator,
)

# The one registry: each class declares its op provider and patch sets (Accelerator.op_provider,
# Accelerator.patch_sets); out-of-tree devices join through the `slime.accelerators` entry-point group.
register_accelerator(AscendAccelerator)
register_accelerator(CudaAccelerator)
register_accelerator(CpuAccelerator)

__all__ = [
    "MEMORY_STAT_KEYS",
    "Accelerator",
    "AcceleratorUnavailable",
    "AscendAccelerator",
    "Capabilities",
    "CpuAccelerator",
    "CudaAccelerator",
    "DeviceConfigError",
    "NullEvent",
    "NullStream",
    "accelerator_class",
    "accelerator_names",
    "get_accelerator",
    "register_accelerator",
    "set_accelerator",
]
