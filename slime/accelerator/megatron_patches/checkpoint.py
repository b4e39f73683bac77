"""megatron.core.dist_checkpointing (torch_dist format) with synchronous saves on a non-CUDA device.

slime saves synchronously (`dist_checkpointing.save`, no async queue). Megatron's torch_dist writer is
built for async saves: it stages tensors to host with `torch.cuda.synchronize()`, keeps the write results
in a queue of a spawned `multiprocessing.Manager` process (which re-imports `__main__`: it fails in a
script without a main guard and costs a process start), and forks one writer process per bucket. In a synchronous save the staged tensors are host tensors by
the time they are written, so the buckets are written by the saving process itself, one after the
other, into a process-local queue. The files written are the same.

Loading the distributed optimizer's state with torch's AdamW (no TransformerEngine / Apex) needs one fix:
megatron copies every per-parameter state key from the checkpoint, `step` included, which it does not store.
"""

from __future__ import annotations

import queue

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch
from slime.accelerator.patches import Patch

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
SAVER = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
DIST_OPT = "megatron.core.optimizer.distrib_optimizer"


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


def make_set_main_param_and_optimizer_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        """Copy the checkpoint's main param / Adam moments of `model_param` into its shard; state keys the
        checkpoint does not hold (torch AdamW's per-parameter `step`, set from the param groups) stay."""
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                dst.copy_(tensors[key])

    return _set_main_param_and_optimizer_states


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
    Patch(name="dist_opt_load_skips_step",
          targets=(f"{DIST_OPT}:DistributedOptimizer._set_main_param_and_optimizer_states",),
          replacement=make_set_main_param_and_optimizer_states,
          why="loading the distributed optimizer's fully-reshardable state with torch's AdamW (no TransformerEngine "
              "or Apex: CPU, Ascend), whose per-parameter state holds 'step'",
          replaces="a copy of every per-parameter state key from the checkpoint's tensors, which hold no 'step' "
                   "(KeyError); load_state_dict sets the step from the param groups just before",
          versions=MEGATRON_VERSIONS,
          remove_when="megatron-core skips non-tensor-state keys (step) in _set_main_param_and_optimizer_states"),
]
