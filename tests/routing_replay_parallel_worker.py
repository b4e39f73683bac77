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
    from replay_helpers import run_layouts

    run_layouts(rank, world, port, ckpt, rollout_path, out_dir, names, "--use-rollout-routing-replay", CONFIGS,
                _biased_routers_measure)


def _biased_routers_measure(name: str, actor, payload) -> dict:
    """With experts 6 and 7 winning every choice the routers make themselves: the log-probs replayed and routed by
    themselves."""
    from replay_helpers import replayed_and_own

    from slime.backends.megatron.rollout_data import batch_from_payload
    from slime.utils.routing_replay import REPLAY
    from slime_plugins.models.common.moe import MoELayer

    for m in actor.model.modules():
        if isinstance(m, MoELayer):
            m.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))
    return replayed_and_own(actor, batch_from_payload(payload), lambda batch: REPLAY.replaying("rollout", batch))


def run_families(rank: int, world: int, port: int, items: list, out_dir: str) -> None:
    """One rank: per (model_type, checkpoint, payload) the trainer's log-probs replayed (weights as the engine's)
    and, with the routers scrambled, the experts each MoE layer used, replayed and by themselves."""
    from contextlib import nullcontext

    from glm5_helpers import init_rank
    from replay_helpers import all_log_probs

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
        with REPLAY.replaying("rollout", batch):
            out = {"replayed": all_log_probs(actor, batch), "ids": {}}
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
                    all_log_probs(actor, batch)
            finally:
                MoELayer.route = original
            out["ids"][replay] = seen
        if rank == 0:
            torch.save(out, os.path.join(out_dir, f"{model_type}.pt"))
        dist.barrier()
    dist.destroy_process_group()
