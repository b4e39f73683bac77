"""Worker of tests/test_trainer_options.py: one spawned trainer rank that runs the real trainer actor with a
named set of train.py flags for two train steps on a fixed rollout batch and saves, per parameter, whether it
is trainable and whether the steps moved it, and the AdamW state the steps left."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "freeze_embeddings": ["--freeze-params-name-list", "embedding", "output_layer"],
    # upstream's Megatron names: the routed experts' fc1 and the MLA query down-projection of layer 1
    "only_upstream_names": ["--only-train-params-name-list", r"mlp\.experts\.experts\.linear_fc1",
                            r"layers\.1\.self_attention\.linear_q_down_proj"],
    "reset": ["--reset-optimizer-states"],
    "stateless_adam": ["--use-stateless-adam", "--global-batch-size", "4"],  # two optimizer steps per rollout
    "balance_flops": ["--balance-by-flops"],
    # per-token loss: train/entropy is then the token mean over the same tokens and weights as rollout/entropy
    "entropy": ["--use-rollout-entropy", "--calculate-per-token-loss", "--rollout-data-postprocess-path",
                "trainer_options_worker.record_entropy"],
    "ref_update": ["--ref-update-interval", "2", "--use-kl-loss", "--kl-loss-coef", "0.1"],
    # the profiler's per-step targets for their first step, then train_overall alone; the host keeps no
    # allocator history (a warning, no file)
    "profile": ["--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "1",
                "--profile-target", "train_actor", "train_log_probs", "--tensorboard-dir",
                "{out}/traces", "--record-memory-history", "--memory-snapshot-dir", "{out}/memory",
                "--memory-snapshot-num-steps", "1", "--log-probs-max-tokens-per-gpu", "16"],
    "profile_overall": ["--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
                        "--profile-target", "train_overall", "--tensorboard-dir", "{out}/traces"],
}


RECORDED: dict = {}


def record_entropy(args, rollout_id, rollout_data):
    """--rollout-data-postprocess-path: what --use-rollout-entropy hands the hooks."""
    RECORDED["entropy"] = [e.clone() for e in rollout_data["entropy"]]
    RECORDED["loss_masks"] = [m.clone() for m in rollout_data["loss_masks"]]


def _payload(fields: dict):
    from types import SimpleNamespace

    from slime.backends.megatron.rollout_data import pack_samples

    return pack_samples([SimpleNamespace(tokens=t, response_length=r, reward=w, loss_mask=m, rollout_log_probs=None)
                         for t, r, w, m in zip(fields["tokens"], fields["response_lengths"], fields["rewards"],
                                               fields["loss_masks"])])


def run(rank: int, world: int, port: int, ckpt: str, batch_path: str, out_dir: str, names: list[str]) -> None:
    from glm5_helpers import init_rank
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.data import RolloutBatch
    from slime.config.arguments import parse_args

    init_rank(rank, world, port)
    fields = torch.load(batch_path)
    for name in names:
        args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "2", "--global-batch-size", "8",
                           "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--lr", "1e-2",
                           "--no-use-distributed-optimizer"] + [f.replace("{out}", out_dir) for f in CONFIGS[name]])
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args, with_ref=args.use_kl_loss)
        params = dict(actor.model.module.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        log_probs = None
        if name.startswith("profile") or name == "plain":
            log_probs = actor.compute_log_probs(RolloutBatch(**{**fields, "reuse_train_log_probs": False}))
            log_probs = log_probs["log_probs"]["old_log_probs"]
        train_fields = fields
        if name == "stateless_adam":  # two steps: the second needs old log-probs from before the first
            old = actor.compute_log_probs(RolloutBatch(**{**fields, "reuse_train_log_probs": False}))
            old = old["log_probs"]["old_log_probs"]
            train_fields = {**fields, "reuse_train_log_probs": False, "old_log_probs": [old[i] for i in range(len(old))]}
        refs, losses = [], []
        if name == "entropy":  # through train_rollout: the old-policy pass, the hooks, the step
            metrics = actor.train_rollout(0, _payload(fields), False)
            torch.save({"metrics": metrics, **RECORDED}, os.path.join(out_dir, f"{name}.pt"))
            actor.shutdown()
            dist.barrier()
            continue
        for rollout_id in (0, 1):
            losses.append(actor.train(rollout_id, RolloutBatch(**train_fields))["train/loss"])
            if actor.ref_weights is not None:  # --ref-update-interval 2: unchanged after rollout 0, the actor's after 1
                updated = actor._maybe_update_reference(rollout_id)
                refs.append((updated, all(torch.equal(actor.ref_weights[n], p.detach().cpu())
                                          for n, p in actor.model.module.named_parameters() if n in actor.ref_weights)))
        actor.shutdown()
        adam = actor.optimizer.chained_optimizers[0].optimizer
        states = [(int(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in adam.state.values()]
        torch.save({"trainable": {n: p.requires_grad for n, p in params.items()},
                    "moved": {n: not torch.equal(before[n], p.detach()) for n, p in params.items()},
                    "betas": adam.param_groups[0]["betas"], "states": states, "log_probs": log_probs,
                    "refs": refs, "losses": losses},
                   os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()
