"""Rank processes for the multi-rank tests: torch.multiprocessing.spawn's contract (`fn(rank, *args)` in
`nprocs` processes, a failing rank's error raised on join), but forked from one fork server per test
session that has imported torch, megatron-core, transformers and slime's trainer once. A plain spawn
re-imports them in every rank (~5 s of CPU each on this 2-core machine; the suite starts ~50 ranks).

Each rank starts from a fork of that clean server (never of the pytest process: no threads, no process
group, no Ray), with the spawning test's environment at spawn time, as a spawned process would.
"""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

PRELOAD = [
    "torch", "torch.distributed", "safetensors.torch", "transformers",
    "slime",  # first: its import hook makes megatron's jit_fuser eager before megatron imports
    "slime.accelerator", "slime.config.arguments", "slime.backends.megatron.actor",
    "slime.backends.megatron.hf_loader", "slime.backends.megatron.hf_export", "slime.backends.megatron.checkpoint.torch_dist",
    "slime.backends.megatron.model_setup", "slime.backends.megatron.optimizer", "slime_plugins.models.glm5.model",
    "megatron.core.dist_checkpointing", "megatron.core.distributed", "megatron.core.models.gpt",
]


def _rank_main(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """Like torch.multiprocessing.spawn(fn, args, nprocs, join); returns its ProcessContext when join=False."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call of the session)
    return mp.start_processes(_rank_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=join,
                              start_method="forkserver")
