"""Worker of tests/test_ppo_critic.py's parallel test: one spawned trainer rank (gloo) that builds the PPO critic
(the real trainer actor with --advantage-estimator ppo) per named layout, takes its values of a fixed rollout,
runs its optimizer step, takes the values again, and has rank 0 write them with the step's value loss."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

CONFIGS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["--no-use-distributed-optimizer"]),
    "dp2": (2, []),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def run(rank: int, world: int, port: int, ckpt: str, batch_path: str, out_dir: str, names: list[str]) -> None:
    from glm5_helpers import init_rank
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.data import RolloutBatch
    from slime.config.arguments import parse_args

    init_rank(rank, world, port)
    fields = torch.load(batch_path)
    for name in names:
        size, flags = CONFIGS[name]
        assert size == world, f"{name} runs at world {size}, not {world}"
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "8",
                           "--use-dynamic-batch-size", "--max-tokens-per-gpu", "48", "--lr", "1e-2",
                           "--adam-eps", "1e-4", "--actor-num-gpus-per-node", str(world),
                           "--advantage-estimator", "ppo", "--lambd", "0.9", *flags])
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        batch = RolloutBatch(**fields)
        everything = list(range(len(batch)))
        before = actor.critic.values_of(batch, everything)
        metrics = actor.critic.train_rollout(0, batch, actor._my_samples(batch))
        after = actor.critic.values_of(batch, everything)
        if rank == 0:
            torch.save({"before": [before[i] for i in everything], "after": [after[i] for i in everything],
                        "value_loss": metrics["critic/value_loss"], "grad_norm": metrics["critic/grad_norm"]},
                       os.path.join(out_dir, f"critic_{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()
