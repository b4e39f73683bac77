"""Everything Ascend-NPU specific: the accelerator, its op implementations and its patch sets.

Nothing here imports torch_npu at module import; it is imported on first use, so a
machine without CANN can import slime (and tests can install a documented-contract stand-in).
"""

from slime.accelerator.ascend.accelerator import AscendAccelerator

__all__ = ["AscendAccelerator"]
