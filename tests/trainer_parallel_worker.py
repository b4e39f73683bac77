"""Worker of tests/test_trainer_parallel.py: one spawned trainer rank (gloo) that runs, per named config,
the real trainer actor (MegatronTrainRayActor: load, DDP + optimizer from the train.py flags, one RL train
step on the fixed rollout batch) and has rank 0 write the loss and the exported HF tensors."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# name -> (world size, train.py flags beyond the common ones)
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["--no-use-distributed-optimizer"]),
    "dp2_distopt": (2, []),
    "dp2_distopt_full_recompute": (2, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                       "--recompute-num-layers", "1"]),
    "dp2_distopt_cpu_offload": (2, ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                                    "--use-precision-aware-optimizer"]),
    "dp2_distopt_overlap": (2, ["--overlap-grad-reduce", "--overlap-param-gather"]),
    "tp2_distopt": (2, ["--tensor-model-parallel-size", "2"]),
    "ep2_distopt": (2, ["--expert-model-parallel-size", "2"]),
    "tp2ep2_distopt": (4, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
}


def common_flags(ckpt: str, world: int) -> list[str]:
    # --adam-eps 1e-4: the first Adam step is lr * g / (|g| + eps), so grads at rounding-noise level (whose
    # sign depends on the summation order) move weights by ~0 instead of +-lr.
    return ["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "8", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", "48", "--lr", "1e-2", "--clip-grad", "1.0", "--adam-eps", "1e-4",
            "--actor-num-gpus-per-node", str(world)]


def run(rank: int, world: int, port: int, ckpt: str, batch_path: str, out_dir: str, names: list[str]) -> None:
    from glm5_helpers import exported_weights, init_rank
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.data import RolloutBatch
    from slime.config.arguments import parse_args

    init_rank(rank, world, port)
    fields = torch.load(batch_path)
    for name in names:
        size, flags = CONFIGS[name]
        assert size == world, f"{name} runs at world {size}, not {world}"
        args = parse_args(common_flags(ckpt, world) + flags)
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        metrics = actor.train(0, RolloutBatch(**fields))
        weights = exported_weights(actor.model)
        if rank == 0:
            torch.save({"loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"], "weights": weights,
                        "optimizer": type(actor.optimizer.chained_optimizers[0]).__name__,
                        "inner": type(actor.optimizer.chained_optimizers[0].optimizer).__name__},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()
