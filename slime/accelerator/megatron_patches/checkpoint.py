"""megatron.core.dist_checkpointing (torch_dist format) with synchronous saves on a non-CUDA device.

slime saves synchronously (`dist_checkpointing.save`, no async queue). Megatron's torch_dist writer is
built for async saves: it stages tensors to host with `torch.cuda.synchronize()`, keeps the write results
in a queue of a spawned `multiprocessing.Manager` process (which re-imports `__main__`: it fails in a
script without a main guard and costs a process start), and forks one writer process per bucket. In a synchronous save the staged tensors are host tensors by
the time they are written, so the buckets are written by the saving process itself, one after the
other, into a process-local queue. The files written are the same.
"""

from __future__ import annotations

import queue

from slime.accelerator.megatron_patches import MEGATRON_VERSIONS
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch
from slime.accelerator.patches import Patch

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
SAVER = "megatron.core.dist_checkpointing.strategies.state_dict_saver"


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """FileSystemWriterAsync.write_preloaded_data_multiproc without the forks: each bucket written here,
    its results (or the first exception) put into `global_results_queue` as megatron's version does."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        extra = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **extra)
        index, out = local.get()
        if isinstance(out, Exception):
            results = out
            break
        results[index] = out
    global_results_queue.put(results)


def _p(name, targets, replacement, why, replaces) -> Patch:
    return Patch(name=name, targets=tuple(targets), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS,
                 remove_when="megatron-core's torch_dist writer has a synchronous host path (no CUDA sync, "
                             "no Manager process)")


PATCHES = [
    _p("dist_ckpt_preload_sync", [f"{WRITER}:FileSystemWriterAsync.preload_tensors"], with_accelerator_torch,
       "every torch_dist save stages the tensors to host memory first",
       "torch.cuda.synchronize() after the (non-blocking) device-to-host copies; re-bound to the accelerator"),
    _p("dist_ckpt_finalize_device", [f"{SAVER}:save_state_dict_async_finalize"], with_accelerator_torch,
       "every torch_dist save broadcasts the coordinator's write-failure flag",
       "torch.cuda.current_device() for the failure-flag tensor; re-bound to the accelerator"),
    _p("dist_ckpt_results_queue", [f"{WRITER}:_get_write_results_queue"], lambda orig: queue.Queue,
       "synchronous saves hand the write results back within the saving process",
       "a queue held by a spawned multiprocessing.Manager process (re-imports __main__, one process start)"),
    _p("dist_ckpt_write_in_process", [f"{WRITER}:FileSystemWriterAsync.write_preloaded_data_multiproc"],
       lambda orig: staticmethod(_write_buckets_in_process),
       "host tensors need no writer processes: the buckets are written by the saving rank itself",
       "one forked writer process per bucket (a fork of the multi-threaded trainer process)"),
]
