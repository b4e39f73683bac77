"""The CPU accelerator's megatron-core patch set (imported lazily by the patch registry)."""

from slime.accelerator.megatron_patches import common_patches, linear, register_set

# linear: fast paths of the communication-free linears, CPU only (checked against megatron's originals on CPU).
register_set("cpu", [*common_patches(), *linear.PATCHES])
