"""`StepRunner`: one rollout's work on a trainer rank, over its `PolicyModel` (slime.backends.megatron.policy).

Per rollout (`train_rollout`): the critic first (--advantage-estimator ppo), the old-policy, reference and
teacher log-probs without grad, advantages, upstream's post-processing hook, then `train`: the optimizer steps
of --global-batch-size samples, each over packed micro-batches through Megatron's schedule with its loss
(slime.backends.megatron.loss), gradient clipping and the step, and the metrics reduced over the
data-parallel group and handed from the last pipeline stage to the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron import ci_checks
from slime.backends.megatron import data as D
from slime.backends.megatron import hooks
from slime.backends.megatron.loss import METRIC_KEYS, MISMATCH_KEYS, LossConfig, LossHooks, rl_loss, sft_loss
from slime.backends.megatron.manual_gc import ManualGC
from slime.backends.megatron.policy import PolicyModel
from slime.backends.megatron.timing import PhaseTimer

logger = logging.getLogger(__name__)


def old_pass_replay(args, batch: D.RolloutBatch):
    """The old-policy log-prob pass: the engine's routes (--use-rollout-routing-replay), or the routers'
    own, recorded for the training pass (--use-routing-replay)."""
    from slime.utils.routing_replay import REPLAY

    if args.use_rollout_routing_replay:
        return _with_indexer_replay(args, batch, REPLAY.replaying("rollout", batch))
    return _with_indexer_replay(args, batch, REPLAY.recording() if args.use_routing_replay
                                else contextlib.nullcontext())


def train_pass_replay(args, batch: D.RolloutBatch):
    """The training pass routes as the old-policy pass did (recorded; none recorded when the training
    forward's own log-probs are the old ones: its routers then are the old policy's)."""
    from slime.utils.routing_replay import REPLAY

    if args.use_rollout_routing_replay:
        return _with_indexer_replay(args, batch, REPLAY.replaying("rollout", batch))
    if args.use_routing_replay and REPLAY.recorded:
        return _with_indexer_replay(args, batch, REPLAY.replaying("recorded"))
    return _with_indexer_replay(args, batch, contextlib.nullcontext())


@contextlib.contextmanager
def _with_indexer_replay(args, batch: D.RolloutBatch, routing):
    """`routing` and, with --use-rollout-indexer-replay, the engine's DSA selections (both policy passes;
    the reference and teacher forwards select by themselves)."""
    from slime.utils.indexer_replay import INDEXER_REPLAY

    with routing:
        if not args.use_rollout_indexer_replay:
            yield
            return
        with INDEXER_REPLAY.replaying(batch):
            yield


@dataclass
class _Tally:
    """What the micro-batches of one rollout's training add up on this data-parallel rank (the last stage's)."""

    totals: dict[str, float]
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))  # samples, loss tokens, real tokens
    # train-rollout log-prob mismatch when the old log-probs come from here: |diff| sum, token count; max
    mismatch: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    mismatch_max: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))
    captured_old: dict[int, torch.Tensor] = field(default_factory=dict)  # --save-debug-train-data, reused old log-probs
    step_loss: float = 0.0
    # per sample (data.rollout_denominators / rollout_shares): a forked rollout's samples reduce to one token mean
    denominators: list[float | None] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)


class StepRunner:
    def __init__(self, args, policy: PolicyModel, critic=None, manual_gc: ManualGC | None = None) -> None:
        self.args, self.policy, self.critic = args, policy, critic
        self.manual_gc = manual_gc or ManualGC(enabled=False)
        self.loss_config = LossConfig.from_args(args)
        self.loss_hooks = LossHooks.from_args(args)  # --custom-tis-function-path, --custom-pg-loss-reducer-...
        self.mtp = bool(args.enable_mtp_training)

    # --- one rollout, end to end on the trainer ----------------------------------------------
    def train_rollout(self, rollout_id: int, batch: D.RolloutBatch, metrics: dict[str, float],
                      started: float) -> dict[str, float]:
        """Log-probs, advantages and training for one rollout (`metrics`: what the call measured before;
        `started`: its perf_counter start). Each rank works on its own data-parallel share."""
        from slime.backends.megatron import train_dump
        from slime.utils.routing_replay import REPLAY

        args, policy = self.args, self.policy
        mine = policy.my_samples(batch)
        untrained = len(batch) - sum(len(step) for step in D.batch_steps(batch, args.global_batch_size))
        if untrained and policy.rank == 0:  # upstream drops them too: steps take whole sets of rollouts
            logger.warning("rollout %d: %d of its %d samples are not trained (their rollouts come after the last "
                           "whole --global-batch-size %d rollouts)", rollout_id, untrained, len(batch),
                           args.global_batch_size)
        if self.critic is not None:  # first, as upstream's critic group: its old values feed the actor's GAE
            metrics.update(self.critic.train_rollout(rollout_id, batch, mine))
            if rollout_id < args.num_critic_only_steps:  # --num-critic-only-steps: the actor does not train yet
                metrics["train/actor_trained"] = 0.0
                return metrics
        self._log_probs(rollout_id, batch, mine, metrics)
        self._advantages(rollout_id, batch, mine, metrics)
        try:
            with train_pass_replay(args, batch):
                metrics.update(self.train(rollout_id, batch))
        finally:
            REPLAY.recorded = {}  # this rollout's routes
        policy.maybe_update_reference(rollout_id)
        ci_checks.check_mismatch(args, metrics)  # --ci-test
        train_dump.dump(args, batch, mine, rollout_id, rank=policy.rank, dp_rank=policy.dp_rank,
                        dp_size=policy.dp_size, dp_group=policy.dp_group,
                        writes=policy.last_stage and policy.tp_rank == 0 and policy.cp_rank == 0)
        # the whole call on this rank: the driver's time/train_call less this is Ray's share (and the data's fetch)
        metrics["time/train_rollout"] = time.perf_counter() - started
        return metrics

    def _log_probs(self, rollout_id: int, batch: D.RolloutBatch, mine: list[int], metrics: dict[str, float]) -> None:
        """Old-policy (with --keep-old-actor: the old actor's weights), reference and teacher log-probs, no grad."""
        from slime.backends.megatron import model_setup

        args, policy = self.args, self.policy
        t0 = time.perf_counter()
        policy.model.eval()

        def full(by_index: dict[int, torch.Tensor]) -> list:
            return [by_index.get(i) for i in range(len(batch))]

        old_pass = not batch.reuse_train_log_probs and args.loss_type != "sft_loss"  # sft: no old log-probs
        entropy = None
        if old_pass:
            hooks.before_log_prob(args, policy.model, "")  # --custom-megatron-before-log-prob-hook-path
            old_weights = (model_setup.swapped_weights(policy.model, policy.old_actor.weights)
                           if policy.old_actor is not None else contextlib.nullcontext())  # --keep-old-actor
            with old_pass_replay(args, batch), old_weights:  # routing replay of the old-policy pass only
                entropy = {} if args.use_rollout_entropy else None  # upstream's: for hooks that mask by entropy
                batch.old_log_probs = full(policy.log_probs_of(batch, mine, entropy))
        if entropy is not None:
            batch.entropy = full(entropy)
            metrics["rollout/entropy"] = policy.token_mean(batch.entropy, batch, mine)
        metrics["time/log_probs_old"] = time.perf_counter() - t0
        if policy.ref_weights is not None:
            hooks.before_log_prob(args, policy.model, "ref_")
            with model_setup.swapped_weights(policy.model, policy.ref_weights):
                batch.ref_log_probs = full(policy.log_probs_of(batch, mine))
        if policy.teacher_weights is not None:  # --use-opd --opd-type megatron
            with model_setup.swapped_weights(policy.model, policy.teacher_weights):
                batch.teacher_log_probs = full(policy.log_probs_of(batch, mine))
        metrics["time/log_probs"] = time.perf_counter() - t0
        metrics["time/log_probs_ref"] = metrics["time/log_probs"] - metrics["time/log_probs_old"]
        if old_pass:
            ci_checks.check_log_probs(args, rollout_id, batch.old_log_probs, batch.ref_log_probs, batch.loss_masks)

    def _advantages(self, rollout_id: int, batch: D.RolloutBatch, mine: list[int], metrics: dict[str, float]) -> None:
        """Advantages and returns over the data-parallel group, the rollout's own log-probs as the old ones
        (--use-rollout-logprobs), then upstream's --rollout-data-postprocess-path hook."""
        from slime.backends.megatron.rollout_data import GroupReduce, share_advantages

        args = self.args
        t = time.perf_counter()
        if args.compute_advantages_and_returns and args.loss_type != "sft_loss":
            metrics.update(share_advantages(args, batch, mine, GroupReduce(self.policy.dp_group)))
        if args.use_rollout_logprobs and batch.rollout_log_probs is not None:
            batch.old_log_probs = [torch.tensor(r, dtype=torch.float32) for r in batch.rollout_log_probs]
        metrics["time/advantages"] = time.perf_counter() - t
        if args.rollout_data_postprocess_path:  # upstream's hook, between advantages and training
            from slime.backends.megatron.rollout_postprocess import postprocess_rollout_data
            from slime.utils.misc import load_function

            postprocess_rollout_data(load_function(args.rollout_data_postprocess_path), args, rollout_id, batch, mine)

    # --- training -------------------------------------------------------------------------
    def metric_keys(self) -> tuple[str, ...]:
        args = self.args
        return METRIC_KEYS + (("mtp_loss",) if self.mtp else ()) + (("opsm_clipfrac",) if args.use_opsm else ()) + (
            MISMATCH_KEYS if args.get_mismatch_metrics else ())

    def train(self, rollout_id: int, batch: D.RolloutBatch) -> dict[str, float]:
        """The rollout's optimizer steps (--global-batch-size samples each); the reduced metrics."""
        from slime.backends.megatron import model_setup

        args, policy, acc = self.args, self.policy, get_accelerator()
        acc.reset_peak_memory_stats()
        t0 = time.perf_counter()
        self.manual_gc.train_start()
        policy.model.train()
        if args.reset_optimizer_states:  # Adam starts over each rollout
            from slime.backends.megatron.optimizer import reset_optimizer_states

            reset_optimizer_states(policy.optimizer)
        keys = self.metric_keys()
        tally = _Tally(totals={k: 0.0 for k in keys}, denominators=D.rollout_denominators(batch),
                       shares=D.rollout_shares(batch))
        grad_norms, losses = [], []
        steps = D.batch_steps(batch, args.global_batch_size)
        policy.profiler.end_log_probs()
        if batch.reuse_train_log_probs and len(steps) != 1:
            raise ValueError(f"reuse_train_log_probs needs one optimizer step per rollout, but {len(batch)} samples make "
                             f"{len(steps)} steps of --global-batch-size {args.global_batch_size}")
        # Phase times from device events, read once after the last step: no synchronize() per phase or micro-batch.
        timer = PhaseTimer(acc, ("pack", "forward", "backward", "optimizer"))
        for step_id, step in policy.profiler.steps("train_actor", enumerate(steps)):
            grad_norm, loss, lr = self._train_step(rollout_id, step_id, batch, step, tally, timer)
            grad_norms.append(grad_norm)
            losses.append(loss)
        if tally.captured_old and batch.old_log_probs is None:
            batch.old_log_probs = [tally.captured_old.get(i) for i in range(len(batch))]
        seconds = timer.seconds()
        seconds["backward"] -= seconds["forward"]
        model_setup.sync_params(policy.model)  # --overlap-param-gather: weight sync and save read the new weights
        policy.profiler.step(rollout_id)
        elapsed = time.perf_counter() - t0
        return self._reduced_metrics(batch, keys, tally, losses, grad_norms, lr, elapsed, seconds)

    def _train_step(self, rollout_id: int, step_id: int, batch: D.RolloutBatch, step: list[int], tally: _Tally,
                    timer: PhaseTimer) -> tuple[float, float, float]:
        """One optimizer step over this rank's shard of `step`: (grad norm, DP-mean loss, its learning rate)."""
        import torch.distributed as dist

        from slime.backends.megatron import model_setup

        args, policy = self.args, self.policy
        # --custom-megatron-before-train-step-hook-path
        hooks.before_train_step(args, rollout_id, step_id, policy.model, policy.optimizer, policy.lr_scheduler)
        shard = policy.dp_shard(batch, step)
        normalizer = self._normalizer(batch, step, shard)
        policy.model.zero_grad_buffer()
        policy.optimizer.zero_grad()
        tally.step_loss = 0.0
        t = timer.mark()
        mbs = [policy.pack(batch, mb_indices) for mb_indices in policy.micro_batches(batch, shard)]
        t = timer.lap("pack", t)

        def on_logits(mb: D.PackedMicroBatch, logits) -> torch.Tensor:
            return self._micro_batch_loss(batch, mb, logits, normalizer, tally)

        policy.run_schedule(mbs, on_logits, forward_only=False, timer=timer, mtp_logits=self.mtp)
        timer.lap("backward", t)  # the schedule's time; its forward share is moved to "forward" by train()
        t = timer.mark()
        lr = float(policy.optimizer.param_groups[0]["lr"])  # this step's learning rate (--lr-decay-style)
        if args.use_stateless_adam:  # Adam from zero moments every step: upstream's StatelessAdam update
            from slime.backends.megatron.optimizer import reset_optimizer_states

            reset_optimizer_states(policy.optimizer)
        grad_norm = model_setup.finish_step(policy.model, policy.optimizer, policy.lr_scheduler,
                                            args.check_for_nan_in_loss_and_grad)
        timer.lap("optimizer", t)
        self.manual_gc.after_step()
        ci_checks.record_grad_norm(args, rollout_id, step_id, grad_norm, policy.rank)  # --ci-save/load-grad-norm
        if step_id == 0 and args.ci_test and policy.last_stage:
            local = max(float(tally.counts[1] if args.calculate_per_token_loss else tally.counts[0]), 1.0)
            ci_checks.check_first_step(args, rollout_id, step_id, tally.totals["ppo_kl"] / local,
                                       tally.totals["kl"] / local if batch.ref_log_probs else None)
        loss_t = torch.tensor([tally.step_loss], dtype=torch.float64)
        dist.all_reduce(loss_t, group=policy.dp_group)
        return grad_norm, float(loss_t.item()) / policy.dp_size, lr

    def _normalizer(self, batch: D.RolloutBatch, step: list[int], shard: list[int]) -> float:
        """The step's loss divisor: its rollouts' share on this rank, or (--calculate-per-token-loss) the DP mean
        of its loss tokens."""
        import torch.distributed as dist

        if not self.args.calculate_per_token_loss:
            return D.sample_mean_normalizer(batch, step, shard, self.policy.dp_size)
        n_tokens = sum(float(sum(batch.loss_masks[i])) for i in shard)
        total = torch.tensor([n_tokens], dtype=torch.float64)
        dist.all_reduce(total, group=self.policy.dp_group)
        return max(float(total.item()) / self.policy.dp_size, 1.0)

    def _micro_batch_loss(self, batch: D.RolloutBatch, mb: D.PackedMicroBatch, logits, normalizer: float,
                          tally: _Tally) -> torch.Tensor:
        """The micro-batch's loss on the last pipeline stage (its metrics added to `tally`)."""
        args, policy = self.args, self.policy
        reuse = batch.reuse_train_log_probs
        logits, mtp_depths = logits if self.mtp else (logits, None)
        log_probs, entropy = D.response_log_probs(policy.sampling_logits(logits), mb, get_accelerator().ops,
                                                  args.log_probs_chunk_size)

        def cat(values):
            return None if values is None else torch.cat([torch.as_tensor(values[i], dtype=torch.float32)
                                                          for i in mb.sample_indices]).to(log_probs.device)

        loss_mask = mb.loss_mask.to(log_probs.device)
        denominators = [tally.denominators[i] for i in mb.sample_indices]
        rollout_lp = cat(batch.rollout_log_probs)
        # Same weights, same packing, same forward as compute_log_probs: its values, detached.
        old = log_probs.detach().float() if reuse else cat(batch.old_log_probs)
        if reuse and args.save_debug_train_data:  # the dump's old log-probs: this forward's
            for i, part in zip(mb.sample_indices, D.split_per_sample(old.cpu(), mb.response_lengths)):
                tally.captured_old[i] = part
        if reuse and rollout_lp is not None:
            diff = (old - rollout_lp).abs() * loss_mask
            tally.mismatch += torch.tensor([float(diff.sum()), float(loss_mask.sum())], dtype=torch.float64)
            tally.mismatch_max = torch.maximum(tally.mismatch_max, torch.tensor(
                [float(diff.max()) if diff.numel() else 0.0], dtype=torch.float64))
        if args.loss_type == "custom_loss":  # upstream's --custom-loss-function-path contract
            from slime.backends.megatron.custom_loss import custom_loss

            loss, m = custom_loss(args, batch, mb, policy.sampling_logits(logits), normalizer, tuple(tally.totals),
                                  old_log_probs=old, denominators=denominators)
        elif args.loss_type == "sft_loss":
            loss, m = sft_loss(log_probs, loss_mask, mb.response_lengths, normalizer, args.calculate_per_token_loss,
                               tuple(tally.totals), denominators)
        else:
            loss, m = rl_loss(self.loss_config, log_probs, entropy, old, cat(batch.advantages), loss_mask,
                              mb.response_lengths, normalizer, ref_log_probs=cat(batch.ref_log_probs),
                              rollout_log_probs=rollout_lp, hooks=self.loss_hooks,
                              total_lengths=[len(batch.tokens[i]) for i in mb.sample_indices],
                              denominators=denominators)
        if self.mtp:
            loss_mtp, m["mtp_loss"] = self._mtp_loss(mb, mtp_depths, loss_mask, normalizer, denominators)
            loss = loss + loss_mtp
        tally.step_loss += float(loss.detach())
        for k in tally.totals:
            tally.totals[k] += m[k]
        tally.counts += torch.tensor([sum(tally.shares[i] for i in mb.sample_indices), float(mb.loss_mask.sum()),
                                      mb.num_tokens],
                                     dtype=torch.float64)
        return loss

    def _mtp_loss(self, mb: D.PackedMicroBatch, depth_logits: list, loss_mask: torch.Tensor, normalizer: float,
                  denominators: list[float | None]) -> tuple[torch.Tensor, float]:
        """--enable-mtp-training: the MTP heads' loss on this micro-batch's response tokens (raw logits: the
        heads learn the model's next-next tokens, not the sampling distribution)."""
        from slime.backends.megatron.loss import mtp_loss

        ops = get_accelerator().ops
        lps, masks = [], []
        for k, logits in enumerate(depth_logits, start=1):
            lp, valid = D.mtp_log_probs(logits, mb, k, ops, chunk_size=self.args.log_probs_chunk_size)
            lps.append(lp)
            masks.append(loss_mask * valid.to(loss_mask.device))
        return mtp_loss(lps, masks, mb.response_lengths, normalizer, self.args.mtp_loss_scaling_factor,
                        self.args.calculate_per_token_loss, denominators)

    def _reduced_metrics(self, batch: D.RolloutBatch, keys: tuple[str, ...], tally: _Tally, losses: list[float],
                         grad_norms: list[float], lr: float, elapsed: float, seconds: dict[str, float]
                         ) -> dict[str, float]:
        """Metrics: sums over this DP rank, then over the data-parallel group; the last pipeline stage computed
        them (and the loss), and hands them to the other stages."""
        import torch.distributed as dist

        args, policy = self.args, self.policy
        reuse_mismatch = batch.reuse_train_log_probs and batch.rollout_log_probs is not None
        vec = torch.cat([torch.tensor([tally.totals[k] for k in keys], dtype=torch.float64), tally.counts])
        dist.all_reduce(vec, group=policy.dp_group)
        mismatch, mismatch_max = tally.mismatch, tally.mismatch_max
        if reuse_mismatch:
            dist.all_reduce(mismatch, group=policy.dp_group)
            dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX, group=policy.dp_group)
        vec, losses_t, mismatch, mismatch_max = policy.from_last_stage(
            vec, torch.tensor(losses, dtype=torch.float64), mismatch, mismatch_max)
        losses = losses_t.tolist()
        n_samples, n_loss_tokens, n_tokens = vec[-3:].tolist()
        denom = n_loss_tokens if args.calculate_per_token_loss else n_samples
        metrics = {f"train/{k}": float(vec[j]) / max(denom, 1.0) for j, k in enumerate(keys)}
        metrics.update({
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/steps": float(len(losses)),
            "train/lr": lr,
            "train/tokens": n_tokens,
            "perf/train_tokens_per_s": n_tokens / max(elapsed, 1e-9),
            "time/train": elapsed,
            "memory/train_peak_bytes": float(get_accelerator().memory_stats()["peak_allocated"]),
            **{f"time/train_{k}": v for k, v in seconds.items()},
        })
        if reuse_mismatch:
            # The driver's train_rollout_logprob_abs_diff (share_advantages over the whole rollout), from this forward.
            metrics["train_rollout_logprob_abs_diff"] = float(mismatch[0] / mismatch[1].clamp_min(1))
            metrics["train_rollout_logprob_abs_diff_max"] = float(mismatch_max[0])
        return metrics
