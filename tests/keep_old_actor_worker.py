"""Worker of tests/test_debug_modes.py's --keep-old-actor test: one trainer rank (MegatronTrainRayActor in-process,
no Ray, gloo world of 1) trains three rollouts through train_rollout, with advance_old_actor() between them as
the loops call it after each weight sync. Each rollout's engine log-probs are set to the log-probs of one earlier
weight copy (computed by the rank's own log-prob pass under those weights), so train_rollout's
train_rollout_logprob_abs_diff is exactly 0 when its old log-probs came from that copy."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch
import torch.distributed as dist


def _samples(seed: int, rewards_seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(rewards_seed)
    out = []
    for _ in range(8):
        tokens = [rng.randrange(3, 500) for _ in range(rng.randint(6, 12))]
        r = rng.randint(2, 4)
        out.append(SimpleNamespace(tokens=tokens, response_length=r, reward=float(torch.rand((), generator=gen)),
                                   loss_mask=[1] * r, rollout_log_probs=[0.0] * r))
    return out


def _log_probs(actor, samples, weights) -> list[list[float]]:
    """The rank's old-policy pass (as train_rollout runs it) under `weights`."""
    from slime.backends.megatron import model_setup
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

    batch = batch_from_payload(pack_samples(samples))
    batch.reuse_train_log_probs = False
    actor.model.eval()
    with model_setup.swapped_weights(actor.model, weights):
        by_index = actor._log_probs_of(batch, actor._my_samples(batch))
    return [by_index[i].tolist() for i in range(len(samples))]


def run(rank: int, port: int, ckpt: str, out_path: str) -> None:
    from slime.backends.megatron import model_setup
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.rollout_data import pack_samples
    from slime.config.arguments import parse_args

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    result = {}
    for interval in (1, 2):
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "3", "--rollout-batch-size", "2",
                           "--n-samples-per-prompt", "4", "--lr", "5e-2", "--keep-old-actor",
                           "--update-weights-interval", str(interval)])
        actor = MegatronTrainRayActor(1, 0)
        actor.init(args)
        weights = [model_setup.host_copy(actor.model)]  # W0, then the weights after each step
        # the copy the old log-probs must come from at each step: interval 1 is upstream's queue (old_actor trails
        # the synced weights by one sync: W0, W0, W1), interval 2 the weights last synced (syncs after step 1 only:
        # W0, W0, W2)
        expected = [0, 0, 1] if interval == 1 else [0, 0, 2]
        runs = []
        for step, source in enumerate(expected):
            samples = _samples(seed=step, rewards_seed=10 + step)
            for s, lp in zip(samples, _log_probs(actor, samples, weights[source])):
                s.rollout_log_probs = lp  # "the engine" generated with weights[source]
            metrics = actor.train_rollout(step, pack_samples(samples), False)
            weights.append(model_setup.host_copy(actor.model))
            runs.append({k: metrics[k] for k in ("train_rollout_logprob_abs_diff", "train/ppo_kl", "train/grad_norm")})
            if (step + 1) % interval == 0:
                actor.advance_old_actor()  # the loops call it after every weight sync
        # how far each step moved the weights (so a copy from another step would give other log-probs)
        moved = [max(float((weights[i + 1][n] - weights[i][n]).abs().max()) for n in weights[i]) for i in range(3)]
        result[interval] = {"runs": runs, "moved": moved}
    torch.save(result, out_path)
    dist.destroy_process_group()
