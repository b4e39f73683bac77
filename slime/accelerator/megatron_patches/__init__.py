"""Megatron-core patch sets: the named functions that hard-code CUDA, replaced by versions that ask
the current accelerator (`get_accelerator()`) for device, RNG, streams and events.

megatron-core calls `torch.cuda.*` in ~500 places; only the ones on the paths slime uses are replaced
(GPT / GLM model forward+backward with TP, SP, EP, the alltoall MoE dispatcher, RNG tracker, DDP,
optimizer and grad clipping, torch_dist checkpoints); megatron's torch.compile'd fusions run eagerly (jit.py).
Every replacement is a `Patch` (why, what it replaces, target versions, remove-when) in one of the topic
modules below; `common_patches()` is the set shared by every non-CUDA accelerator (CPU and Ascend), `cpu.py`
registers the CPU set, `ascend/megatron_patches.py` the Ascend one. CUDA needs none.
"""

from __future__ import annotations

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS  # noqa: F401 (also this package's API)
from slime.accelerator.patches import Patch


def common_patches() -> list[Patch]:
    """Patches every accelerator without CUDA needs (CPU, Ascend). Imports megatron.core lazily."""
    from slime.accelerator.megatron_patches import checkpoint, comm, jit, memory, moe, offload, optim, pipeline, rng

    return [*rng.PATCHES, *memory.PATCHES, *comm.PATCHES, *moe.PATCHES, *optim.PATCHES, *offload.PATCHES,
            *pipeline.PATCHES, *checkpoint.PATCHES, *jit.PATCHES]


def register_set(accelerator: str, patches: list[Patch]) -> None:
    """Register `patches`, after importing every target module: a module imported in the middle of
    applying (e.g. one doing `from .clip_grads import get_grad_norm_fp32`) would otherwise bind an
    already-patched function and record it as its original, so revert would not restore it."""
    import importlib

    from slime.accelerator.patches import register_patch

    for p in patches:
        for target in p.targets:
            importlib.import_module(target.split(":", 1)[0])
    for p in patches:
        register_patch(accelerator, "megatron", p)


def register_common(accelerator: str) -> None:
    """The shared set for an accelerator without CUDA, as a `patch_sets` entry of its class:
    `{"megatron": "slime.accelerator.megatron_patches:register_common"}` (an out-of-tree device's)."""
    register_set(accelerator, common_patches())
