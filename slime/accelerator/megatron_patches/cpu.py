"""The CPU accelerator's megatron-core patch set (imported lazily by the patch registry)."""

from slime.accelerator.megatron_patches import common_patches, register_set

register_set("cpu", common_patches())
