"""Shared pieces of the rollout replay tests (MoE routing replay: tests/test_routing_replay.py; DSA indexer replay:
tests/test_glm5_next_indexer_replay.py and its _combined file) and of their spawned parallel-layout workers
(tests/routing_replay_parallel_worker.py, tests/indexer_replay_parallel_worker.py)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch


def max_diff(got, want) -> float:
    """The largest |trainer - engine| log-prob over all samples: `got` the trainer's tensors, `want` the engine's
    per-sample lists."""
    return max(float((x - torch.tensor(y)).abs().max()) for x, y in zip(got, want))


def all_log_probs(actor, batch) -> list:
    """The trainer's old-policy log-probs (no grad) of every sample of `batch`, in sample order."""
    everything = list(range(len(batch)))
    out = actor._log_probs_of(batch, everything)
    return [out[i] for i in everything]


def replayed_and_own(actor, batch, replaying) -> dict:
    """{True: the log-probs with `replaying(batch)` entered, False: with the trainer choosing by itself}."""
    out = {}
    for replay in (True, False):
        with replaying(batch) if replay else nullcontext():
            out[replay] = all_log_probs(actor, batch)
    return out


def run_layouts(rank: int, world: int, port: int, ckpt: str, rollout_path: str, out_dir: str, names: list[str],
                replay_flag: str, layouts: dict[str, list[str]], measure) -> None:
    """One spawned trainer rank (gloo): per layout name a fresh trainer on `ckpt` (one rollout, 4 samples a step in
    micro-batches of 2) with `replay_flag` and the layout's flags; every rank runs `measure(name, actor, payload)`
    (it may hold collectives) and rank 0 saves what it returns as out_dir/<name>.pt."""
    import torch.distributed as dist
    from glm5_helpers import init_rank

    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.config.arguments import parse_args

    init_rank(rank, world, port)
    payload = torch.load(rollout_path, weights_only=False)
    for name in names:
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "4",
                           "--micro-batch-size", "2", "--actor-num-gpus-per-node", str(world),
                           replay_flag, *layouts[name]])
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        out = measure(name, actor, payload)
        if rank == 0:
            torch.save(out, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()
