"""The Ascend accelerator's megatron-core patch set (imported lazily by the patch registry).

Ascend has no CUDA either, so it takes the shared set, whose replacements ask the accelerator for device,
RNG, streams and events (torch.npu through AscendAccelerator). No global torch.cuda -> torch.npu remapping.
"""

from slime.accelerator.megatron_patches import common_patches, register_set

register_set("npu", common_patches())
