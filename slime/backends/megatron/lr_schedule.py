"""Learning-rate and weight-decay schedule of the trainer: Megatron's `OptimizerParamScheduler`, driven
by upstream's flags (--lr-decay-style, --lr-warmup-iters/--lr-warmup-fraction, --min-lr, ...).

One scheduler step per optimizer step. An RL run has num_rollout * (optimizer steps per rollout)
steps; --lr-decay-iters defaults to all of them. The schedule is a pure function of the step count,
so a resumed run advances a fresh scheduler to its step instead of storing scheduler state.
"""

from __future__ import annotations

from typing import Any


def steps_per_rollout(args: Any) -> int:
    if args.rollout_batch_size is None:  # a trainer driven without rollout flags: one step per call
        return 1
    return max(1, args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size)


def schedule_steps(args: Any) -> tuple[int, int, int]:
    """(warmup steps, decay steps, total optimizer steps of the run)."""
    total = args.num_rollout * steps_per_rollout(args)
    decay = args.lr_decay_iters or total
    warmup = int(args.lr_warmup_fraction * decay) if args.lr_warmup_fraction is not None else args.lr_warmup_iters
    return warmup, decay, total


def build_lr_scheduler(args: Any, optimizer: Any, start_rollout_id: int = 0):
    """Megatron's scheduler over `optimizer`, advanced to the first step of `start_rollout_id`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup, decay, _ = schedule_steps(args)
    wd_start = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    wd_end = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1) if args.lr_decay_style != "constant" else max(decay, 1),
        lr_decay_style=args.lr_decay_style, start_wd=wd_start, end_wd=wd_end, wd_incr_steps=max(decay, 1),
        wd_incr_style=args.weight_decay_incr_style, use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True, wsd_decay_steps=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style)
    first = start_rollout_id * steps_per_rollout(args)
    if first:
        scheduler.step(increment=first)
    return scheduler
