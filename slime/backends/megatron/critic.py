"""The PPO critic of `--advantage-estimator ppo` (upstream's critic role), on the trainer's own ranks.

The critic is the policy's network from --hf-checkpoint with its output layer replaced by a value head
(hidden -> 1, weights N(0, 0.02), bias 0, as upstream's), built in the same model-parallel groups as the
actor, with its own Megatron optimizer and LR schedule (its flags: the command line's, with the critic role of
--megatron-config-path over them). Per rollout, before the actor:

    values   V_old of every response token (no grad; the value at logit row t scores the state before token t+1)
    returns  GAE returns of the token rewards (the sample's reward on its last token; the critic role has no
             KL term, as upstream's), R = A + V_old
    train    the clipped value loss max((V - R)^2, (V_clip - R)^2) over the same optimizer steps as the actor

and hands V_old to the actor, whose advantages are GAE against them (slime.utils.ppo_utils.compute_advantages).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from slime.backends.megatron import data as D
from slime.utils import ppo_utils

VALUE_HEAD_STD = 0.02  # upstream's value-head initialisation (init_method_std's default)


class ValueHead(torch.nn.Module):
    """hidden [S(/tp), B, H] -> values [S, B, 1] in float32, replicated over tensor-parallel ranks. Called as the
    model's output layer: (hidden, weight=None) -> (values, None). Under sequence parallel the sequence is
    gathered first; its backward hands each rank the grad of its own rows (every TP rank computes the same
    loss), so the head's grads are already equal on every TP rank and need no reduction."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, seed: int, device) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(1, hidden_size, generator=g).mul_(VALUE_HEAD_STD).to(device))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None):
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden.float(), self.weight, self.bias), None


def build_value_model(args) -> torch.nn.Module:
    """The critic network: --hf-checkpoint's model, value head instead of the output layer (last stage)."""
    from slime.backends.megatron import model_setup

    model = model_setup.load_model(args, args.hf_checkpoint)
    if model.post_process:
        device = next(model.parameters()).device
        model.output_layer = ValueHead(model.arch.hidden_size, bool(model.config.sequence_parallel), args.seed, device)
        model.share_embeddings_and_output_weights = False  # upstream's critic unties them too
        model.gather_logits = False  # one value per position, on every TP rank already
    return model


def critic_checkpoint_dir(args, which: str) -> str | None:
    """Where the critic's checkpoint is written (which='save') or read ('load'): the critic role's own
    --megatron-config-path value when it sets one, else '<actor's dir>/critic'."""
    own, actor = getattr(args.critic_args, which), getattr(args, which)
    if own and own != actor:
        return own
    return os.path.join(actor, "critic") if actor else None


class Critic:
    """Value model, optimizer and schedule of one trainer rank; `policy` (the actor's PolicyModel) packs and
    shards the batch."""

    def __init__(self, policy, args) -> None:
        from slime.backends.megatron.checkpoint import torch_dist as ckpt
        from slime.backends.megatron import model_setup

        self.policy, self.args = policy, args.critic_args
        model = build_value_model(self.args)
        self.model, self.optimizer = model_setup.wrap_and_build_optimizer(self.args, model)
        start = 0
        load = critic_checkpoint_dir(args, "load")
        found = ckpt.find_checkpoint(load) if load and os.path.isdir(load) else None
        if found is not None and found.kind == ckpt.TORCH_DIST:
            start = ckpt.load(load, self.model, self.optimizer, policy.rank, policy.layout(),
                              ckpt.LoadOptions.from_args(self.args)).start_rollout_id
        self.lr_scheduler = model_setup.build_lr_scheduler(self.args, self.optimizer, start)

    def save(self, args, rollout_id: int) -> None:
        from slime.backends.megatron.checkpoint import torch_dist as ckpt

        ckpt.save(critic_checkpoint_dir(args, "save"), rollout_id, self.model, self.optimizer, self.policy.rank,
                  self.policy.layout(), {"rollout_id": rollout_id}, vocab_divisible_by=self.args.make_vocab_size_divisible_by)

    def _forward(self, micro_batches, on_values, forward_only: bool) -> None:
        from slime.backends.megatron import model_setup
        from slime.backends.megatron.pipeline import forward_backward

        device = self.policy.device

        def on_logits(mb, out):
            flat = out.reshape(-1)  # [T]: one value per packed position
            return on_values(mb, flat.index_select(0, mb.response_logit_rows.to(flat.device)))

        forward_backward(self.model, micro_batches, lambda m, mb: model_setup.forward(m, mb, device), on_logits,
                         forward_only)

    @torch.no_grad()
    def values_of(self, batch: D.RolloutBatch, indices: list[int]) -> dict[int, torch.Tensor]:
        """Per-sample values of the response tokens of `indices`, on every pipeline stage."""
        out: dict[int, torch.Tensor] = {}
        zero = torch.zeros((), device=self.policy.device)

        def on_values(mb, values):
            for i, part in zip(mb.sample_indices, D.split_per_sample(values.float().cpu(), mb.response_lengths)):
                out[i] = part
            return zero.clone()

        self.model.eval()
        mbs = [self.policy.pack(batch, m) for m in self.policy.micro_batches(batch, indices)]
        self._forward(mbs, on_values, forward_only=True)
        if self.policy.pp_size == 1 or not indices:
            return out
        lengths = [batch.response_lengths[i] for i in indices]
        flat = torch.cat([out[i] for i in indices]) if self.policy.last_stage else torch.empty(sum(lengths))
        (flat,) = self.policy.from_last_stage(flat)
        return dict(zip(indices, D.split_per_sample(flat.float(), lengths)))

    def returns_of(self, batch: D.RolloutBatch, indices: list[int]) -> dict[int, torch.Tensor]:
        """GAE returns A + V_old of the critic role's token rewards (reward on the last token, no KL term)."""
        lengths = [int(batch.response_lengths[i]) for i in indices]
        if not indices:
            return {}
        rewards = torch.tensor([float(batch.rewards[i]) for i in indices])
        values = torch.cat([batch.values[i] for i in indices])
        token_rewards = ppo_utils.ppo_token_rewards(rewards, torch.zeros(sum(lengths)), lengths, 0.0)
        _, returns = ppo_utils.gae(token_rewards, values, lengths, self.args.gamma, self.args.lambd)
        return dict(zip(indices, D.split_per_sample(returns, lengths)))

    def train_rollout(self, rollout_id: int, batch: D.RolloutBatch, mine: list[int]) -> dict[str, float]:
        """V_old (left in batch.values for the actor's advantages), returns, and the critic's optimizer steps."""
        t0 = time.perf_counter()
        old = self.values_of(batch, mine)
        batch.values = [old.get(i) for i in range(len(batch))]
        returns = self.returns_of(batch, mine)
        metrics = {"time/critic_values": time.perf_counter() - t0}
        metrics.update(self.train(batch, returns))
        return metrics

    def train(self, batch: D.RolloutBatch, returns: dict[int, torch.Tensor]) -> dict[str, float]:
        import torch.distributed as dist

        from slime.backends.megatron import model_setup

        t0 = time.perf_counter()
        args, policy = self.args, self.policy
        self.model.train()
        sums = torch.zeros(4, dtype=torch.float64)  # value loss, clip fraction, rollouts, loss tokens
        grad_norms = []
        denominators, shares = D.rollout_denominators(batch), D.rollout_shares(batch)
        for step in D.batch_steps(batch, args.global_batch_size):
            shard = policy.dp_shard(batch, step)
            if args.calculate_per_token_loss:
                total = torch.tensor([sum(float(sum(batch.loss_masks[i])) for i in shard)], dtype=torch.float64)
                dist.all_reduce(total, group=policy.dp_group)
                normalizer = max(float(total.item()) / policy.dp_size, 1.0)
            else:
                normalizer = D.sample_mean_normalizer(batch, step, shard, policy.dp_size)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()

            def on_values(mb, values):
                def cat(by_index):
                    return torch.cat([by_index[i] for i in mb.sample_indices]).to(values.device)

                mask = mb.loss_mask.to(values.device)
                loss, clipped = ppo_utils.value_loss(values, cat(batch.values), cat(returns), args.value_clip)

                def reduce(v):
                    return (v * mask).sum() if args.calculate_per_token_loss else \
                        ppo_utils.sample_mean_sum(v, mb.response_lengths, mask,
                                                  [denominators[i] for i in mb.sample_indices])

                total = reduce(loss)
                sums.add_(torch.tensor([float(total.detach()), float(reduce(clipped)),
                                        sum(shares[i] for i in mb.sample_indices),
                                        float(mask.sum())], dtype=torch.float64))
                return total / normalizer  # noqa: B023 (runs within this step)

            mbs = [policy.pack(batch, m) for m in policy.micro_batches(batch, shard)]
            self._forward(mbs, on_values, forward_only=False)
            lr = float(self.optimizer.param_groups[0]["lr"])
            grad_norms.append(model_setup.finish_step(self.model, self.optimizer, self.lr_scheduler,
                                                      args.check_for_nan_in_loss_and_grad))
        model_setup.sync_params(self.model)
        dist.all_reduce(sums, group=policy.dp_group)
        (sums,) = policy.from_last_stage(sums)
        loss_sum, clip_sum, n_samples, n_tokens = sums.tolist()
        denom = max(n_tokens if args.calculate_per_token_loss else n_samples, 1.0)
        return {"critic/value_loss": loss_sum / denom, "critic/value_clipfrac": clip_sum / denom,
                "critic/grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "critic/lr": lr,
                "time/critic_train": time.perf_counter() - t0}

    def state(self) -> dict[str, Any]:
        from slime.backends.megatron import model_setup

        return model_setup.host_copy(self.model)
