"""Upstream slime's three Megatron hooks, called by the trainer at upstream's points:

    --custom-megatron-init-path                    fn(args) after the model, optimizer and LR schedule exist
    --custom-megatron-before-log-prob-hook-path    fn(args, model, store_prefix) before each log-prob pass
                                                   ("" for the old policy, "ref_" for the reference)
    --custom-megatron-before-train-step-hook-path  fn(args, rollout_id, step_id, model, optimizer,
                                                   opt_param_scheduler) before each optimizer step's forward
"""

from __future__ import annotations

from typing import Any

from slime.utils.misc import load_function


def _hook(args: Any, flag: str):
    path = getattr(args, flag)
    return load_function(path) if path else None


def on_init(args: Any) -> None:
    fn = _hook(args, "custom_megatron_init_path")
    if fn is not None:
        fn(args)


def before_log_prob(args: Any, model: Any, store_prefix: str) -> None:
    fn = _hook(args, "custom_megatron_before_log_prob_hook_path")
    if fn is not None:
        fn(args, model, store_prefix)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
    fn = _hook(args, "custom_megatron_before_train_step_hook_path")
    if fn is not None:
        fn(args, rollout_id, step_id, model, optimizer, scheduler)
