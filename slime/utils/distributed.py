"""Standalone collective groups between a trainer rank and rollout engines (weight broadcast).

The group is created from its own TCP store and is never the default group, so a trainer's
Megatron world and an engine process without any world are both left untouched. Rank 0 is the
trainer (it hosts the store); engines join with rank >= 1. The backend defaults to
`get_accelerator().process_group_backend()` ("gloo" on CPU, the device's collective library on a
device, with gloo for host tensors).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slime.accelerator import get_accelerator

DEFAULT_TIMEOUT_S = 600.0


def init_custom_process_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Join (rank > 0) or host (rank 0) a group of `world_size` processes; returns the ProcessGroup.

    Blocks until all ranks have joined or `timeout_s` passes.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    backend = backend or get_accelerator().process_group_backend()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore(f"slime/{group_name}/", store)
    # torch has no public constructor for a group outside the default world; this private helper is
    # what new_group uses underneath (checked on torch 2.6-2.13).
    pg = c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout)
    if isinstance(pg, tuple):  # some torch versions return (pg, prefix_store)
        pg = pg[0]
    # Group rank == rank here; register it so collectives can translate src/dst ranks.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Broadcast `tensor` in place from group rank `src` of a custom group."""
    dist.broadcast(tensor, group=group, group_src=src)


def destroy_custom_process_group(group: Any) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:
        # Older torch refuses to destroy a group it did not register in the default world; drop our refs.
        c10d._world.pg_group_ranks.pop(group, None)
