"""Standalone collective groups between a trainer rank and rollout engines (weight broadcast), formed
exactly as SGLang's `init_weights_update_group` forms them, so a real SGLang server joins them.

SGLang (sglang/srt/utils/common.py `init_custom_process_group`, called by its weight updater with
`init_method="tcp://master_address:master_port"`, `rank = rank_offset + tp_rank`): torch's TCP rendezvous
(a TCPStore at the master address; multi-tenant), wrapped in `PrefixStore(group_name, store)` (the bare
group name), then `_new_process_group_helper(world_size, rank, [], Backend(backend), prefix_store,
group_name=group_name, timeout=...)`, registered with ranks {i: i}. Rank 0 is the trainer, which hosts the
store (`GroupHost`); engines join with rank >= 1 through `init_custom_process_group`.

The group is never the default group, so a trainer's Megatron world and an engine process without any
world are both left untouched. The backend defaults to `get_accelerator().process_group_backend()`.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slime.accelerator import get_accelerator

DEFAULT_TIMEOUT_S = 600.0


class GroupFormationError(RuntimeError):
    """The weight-update group did not form (a peer refused or did not join in time)."""


def _new_group(world_size: int, rank: int, store: Any, group_name: str, backend: str, timeout: timedelta) -> Any:
    # torch has no public constructor for a group outside the default world; this private helper is what
    # new_group (and SGLang) use underneath (checked on torch 2.6-2.13).
    pg = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), dist.PrefixStore(group_name, store),
                                        group_name=group_name, timeout=timeout)
    if isinstance(pg, tuple):  # (pg, prefix_store) on torch >= 2.1
        pg = pg[0]
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == rank
    return pg


def init_custom_process_group(master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                              backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Join a group as rank `rank` (> 0: an engine) through the TCP rendezvous at master_address:master_port,
    as SGLang's engines do. Blocks until every rank has joined or `timeout_s` passes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    backend = backend or get_accelerator().process_group_backend()
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in str(master_address) else master_address
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{int(master_port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return _new_group(world_size, rank, store, group_name, backend, timeout)


class GroupHost:
    """Rank 0's side: hosts the rendezvous store the engines connect to, and joins as rank 0 on a helper
    thread, so that a peer's refusal (reported over HTTP) ends the wait early. `abort()` stops the store,
    which makes every rendezvous still waiting on it fail, here and in the engines."""

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.addr, self.port, self.world_size, self.group_name = master_address, int(master_port), world_size, group_name
        self.backend = backend or get_accelerator().process_group_backend()
        self.timeout_s = timeout_s
        self.server = dist.TCPStore(master_address, self.port, world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s), multi_tenant=True)

    def join(self, refused: Callable[[], BaseException | None] = lambda: None) -> Any:
        """The group, once every engine rank has joined; GroupFormationError when `refused()` returns an
        error first or `timeout_s` passes."""
        out: dict[str, Any] = {}

        def form() -> None:
            try:
                out["pg"] = _new_group(self.world_size, 0, self.server, self.group_name, self.backend,
                                       timedelta(seconds=self.timeout_s))
            except BaseException as e:  # noqa: BLE001 - reported by join
                out["error"] = e

        t = threading.Thread(target=form, name="weight-group-rendezvous", daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive():
            why = refused()
            if why is not None:
                raise GroupFormationError(str(why).splitlines()[0] if str(why) else type(why).__name__)
            if time.monotonic() > deadline:
                raise GroupFormationError(f"not every engine joined the weight-update group within {self.timeout_s:.0f} s")
            t.join(0.05)
        if "error" in out:
            raise GroupFormationError(f"weight-update group: {out['error']}") from out["error"]
        return out["pg"]

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        self.server = None


def broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Broadcast `tensor` in place from group rank `src` of a custom group."""
    dist.broadcast(tensor, group=group, group_src=src)


def broadcast_async(tensor: torch.Tensor, src: int, group: Any) -> Any:
    """Start the broadcast; returns its Work (`is_completed()`, `wait()`)."""
    return dist.broadcast(tensor, group=group, group_src=src, async_op=True)


def abort_custom_process_group(group: Any) -> None:
    """Stop the group's pending work where the backend can (gloo, NCCL); never blocks."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        try:
            abort()
        except Exception:
            pass


def destroy_custom_process_group(group: Any) -> None:
    """Unregister the group. Its gloo worker threads stop only when the caller drops its last reference: a
    process that exits still holding the group frees it during interpreter shutdown, where a worker releasing
    its last collective's tensors needs the GIL, is ended by Python, and the process aborts."""
    try:
        dist.destroy_process_group(group)
    except Exception:
        # Older torch refuses to destroy a group it did not register in the default world; drop our refs.
        c10d._world.pg_group_ranks.pop(group, None)


def default_store() -> Any:
    """The default group's key-value store (torch keeps it private; same on torch 2.6-2.13)."""
    return c10d._get_default_store()
