"""Worker of tests/test_routing_replay.py: one spawned trainer rank (gloo) with --use-rollout-routing-replay at
TP2 (sequence parallel: each MoE layer sees its rank's slice of the packed tokens), CP2 (its rank's chunks) or
EP2; with the routers' expert bias changed it computes the rollout's log-probs replayed and routed by
themselves, and rank 0 writes both."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

CONFIGS = {"tp2": ["--tensor-model-parallel-size", "2"], "cp2": ["--context-parallel-size", "2"],
           "ep2": ["--expert-model-parallel-size", "2"]}


def run(rank: int, world: int, port: int, ckpt: str, rollout_path: str, out_dir: str, names: list[str]) -> None:
    from contextlib import nullcontext

    from glm5_helpers import init_rank
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.rollout_data import batch_from_payload
    from slime.config.arguments import parse_args
    from slime.utils.routing_replay import REPLAY
    from slime_plugins.models.common.moe import MoELayer

    init_rank(rank, world, port)
    payload = torch.load(rollout_path, weights_only=False)
    for name in names:
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "4",
                           "--micro-batch-size", "2", "--actor-num-gpus-per-node", str(world),
                           "--use-rollout-routing-replay", *CONFIGS[name]])
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        for m in actor.model.modules():
            if isinstance(m, MoELayer):  # experts 6 and 7 win every choice the routers make themselves
                m.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))
        batch = batch_from_payload(payload)
        everything = list(range(len(batch)))
        out = {}
        for replay in (True, False):
            with REPLAY.replaying("rollout", batch) if replay else nullcontext():
                lp = actor._log_probs_of(batch, everything)
            out[replay] = [lp[i] for i in everything]
        if rank == 0:
            torch.save(out, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def run_families(rank: int, world: int, port: int, items: list, out_dir: str) -> None:
    """One rank: per (model_type, checkpoint, payload) the trainer's log-probs replayed (weights as the engine's)
    and, with the routers scrambled, the experts each MoE layer used, replayed and by themselves."""
    from contextlib import nullcontext

    from glm5_helpers import init_rank
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.rollout_data import batch_from_payload
    from slime.config.arguments import parse_args
    from slime.utils.routing_replay import REPLAY
    from slime_plugins.models.common.moe import MoELayer

    init_rank(rank, world, port)
    original = MoELayer.route
    for model_type, ckpt, payload_path in items:
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "4",
                           "--micro-batch-size", "4", "--use-rollout-routing-replay"])
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        batch = batch_from_payload(torch.load(payload_path, weights_only=False))
        everything = list(range(len(batch)))
        with REPLAY.replaying("rollout", batch):
            lp = actor._log_probs_of(batch, everything)
        out = {"replayed": [lp[i] for i in everything], "ids": {}}
        layers = [m for m in actor.model.modules() if isinstance(m, MoELayer)]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in layers:
                m.router_weight.copy_(torch.randn(m.router_weight.shape, generator=gen))
        for replay in (True, False):
            seen = {}

            def spy(self, x, seen=seen):
                w, ids = original(self, x)
                seen[self.replay_layer] = ids.detach().cpu()
                return w, ids

            MoELayer.route = spy
            try:
                with REPLAY.replaying("rollout", batch) if replay else nullcontext():
                    actor._log_probs_of(batch, everything)
            finally:
                MoELayer.route = original
            out["ids"][replay] = seen
        if rank == 0:
            torch.save(out, os.path.join(out_dir, f"{model_type}.pt"))
        dist.barrier()
    dist.destroy_process_group()
