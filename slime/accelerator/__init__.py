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
    NullEvent,
    NullStream,
)
from slime.accelerator.cpu import CpuAccelerator
from slime.accelerator.cuda import CudaAccelerator
from slime.accelerator.patches import register_patch_loader
from slime.accelerator.registry import (
    accelerator_class,
    accelerator_names,
    get_accelerator,
    register_accelerator,
    set_accelerator,
)

register_accelerator(AscendAccelerator)
register_accelerator(CudaAccelerator)
register_accelerator(CpuAccelerator)


def _load_megatron_patches(module: str):
    def load() -> None:
        import importlib

        importlib.import_module(module)

    return load


# megatron-core patch sets, imported on first apply_patches("megatron") (CUDA needs none).
register_patch_loader("cpu", "megatron", _load_megatron_patches("slime.accelerator.megatron_patches.cpu"))
register_patch_loader("npu", "megatron", _load_megatron_patches("slime.accelerator.ascend.megatron_patches"))


def _load_transformers_patches(accelerator: str):
    def load() -> None:
        from slime.accelerator import transformers_patches

        transformers_patches.register(accelerator)

    return load


# transformers patch set (GLM-5 DSA indexer tie rule), the same on every built-in accelerator.
for _name in ("cpu", "cuda", "npu"):
    register_patch_loader(_name, "transformers", _load_transformers_patches(_name))
del _name

__all__ = [
    "MEMORY_STAT_KEYS",
    "Accelerator",
    "AcceleratorUnavailable",
    "AscendAccelerator",
    "Capabilities",
    "CpuAccelerator",
    "CudaAccelerator",
    "NullEvent",
    "NullStream",
    "accelerator_class",
    "accelerator_names",
    "get_accelerator",
    "register_accelerator",
    "set_accelerator",
]
