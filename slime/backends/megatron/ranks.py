"""The trainer rank and a barrier that also hold outside a torch.distributed world (one process: tools, tests).
A leaf shared by the checkpoint writer and its background saver (slime.backends.megatron.checkpoint.async_save)."""

from __future__ import annotations


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
