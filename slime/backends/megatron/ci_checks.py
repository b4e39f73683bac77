"""Upstream slime's `--ci-test` assertions on the trainer's numbers, and `--ci-save-grad-norm` /
`--ci-load-grad-norm` (a run's grad norms recorded, then required of a later run). A failed check stops the run
with one line naming the number, its bound and the flag that asked for it."""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

FIRST_STEP_KL_BOUND = 1e-8  # upstream's: the policy equals the old and the reference policy before its first update


class CICheckError(AssertionError):
    """A --ci-test / --ci-load-grad-norm check failed (one line)."""


def _token_mean(per_sample: Sequence[torch.Tensor | None], masks: Sequence) -> float:
    total = count = 0.0
    for lp, mask in zip(per_sample, masks):
        if lp is None:
            continue
        m = torch.as_tensor(mask, dtype=torch.float64)
        total += float((lp.double() * m).sum())
        count += float(m.sum())
    return total / count if count else math.nan


def check_log_probs(args, rollout_id: int, old: Sequence, ref: Sequence | None, masks: Sequence) -> None:
    """Upstream's rollout checks: at rollout 0 the old and reference log-probs agree (same weights), and the mean
    old log-prob lies in (-1, 0). Over this rank's samples (None entries are other ranks')."""
    if not args.ci_test or not old:
        return
    mean_old = _token_mean(old, masks)
    if math.isnan(mean_old):
        return
    # rollout routing replay: the actor routes as the engine did, the reference by itself (upstream's exception)
    if rollout_id == 0 and ref is not None and not args.ci_disable_kl_checker and not args.use_rollout_routing_replay:
        mean_ref = _token_mean(ref, masks)
        if not abs(mean_old - mean_ref) < FIRST_STEP_KL_BOUND:
            raise CICheckError(f"--ci-test: rollout 0's mean log-prob {mean_old:.10g} differs from the reference's "
                               f"{mean_ref:.10g} by more than {FIRST_STEP_KL_BOUND:g} (--ci-disable-kl-checker skips this)")
    if not -1.0 < mean_old < 0.0:
        raise CICheckError(f"--ci-test: rollout {rollout_id}'s mean log-prob {mean_old:.6g} is outside (-1, 0)")


def check_first_step(args, rollout_id: int, step_id: int, ppo_kl: float, kl: float | None) -> None:
    """Step 0 of every rollout: |ppo_kl| ~ 0 (old log-probs from these weights); step 0 of the run: the KL to
    the reference ~ 0. `ppo_kl` / `kl` are this rank's token means over the step."""
    if not args.ci_test or args.ci_disable_kl_checker or step_id != 0:
        return
    if not args.use_rollout_logprobs and not abs(ppo_kl) < FIRST_STEP_KL_BOUND:
        raise CICheckError(f"--ci-test: rollout {rollout_id} step 0's ppo_kl {ppo_kl:.3g} is not below "
                           f"{FIRST_STEP_KL_BOUND:g} (old log-probs should come from the same weights)")
    if (rollout_id == 0 and kl is not None and not args.use_rollout_routing_replay
            and not abs(kl) < FIRST_STEP_KL_BOUND):
        raise CICheckError(f"--ci-test: the first step's KL to the reference {kl:.3g} is not below "
                           f"{FIRST_STEP_KL_BOUND:g} (the reference should equal the initial weights)")


def check_mismatch(args, metrics: dict) -> None:
    value = metrics.get("train_rollout_logprob_abs_diff")
    if not args.ci_test or value is None or math.isnan(value):
        return
    bound = args.ci_train_rollout_logprob_abs_diff_threshold
    if not value <= bound:
        raise CICheckError(f"--ci-test: train_rollout_logprob_abs_diff {value:.6g} is above "
                           f"--ci-train-rollout-logprob-abs-diff-threshold {bound:g}")


def _grad_norm_path(template: str, role: str, rollout_id: int, step_id: int) -> str:
    return template.format(role=role, rollout_id=rollout_id, step_id=step_id)


def record_grad_norm(args, rollout_id: int, step_id: int, grad_norm: float, rank: int, role: str = "actor") -> None:
    """--ci-save-grad-norm: write it (rank 0; a plain float through torch.save, read back weights_only);
    --ci-load-grad-norm: require it within 0.01 (relative or absolute) of the saved one."""
    if args.ci_save_grad_norm:
        if rank != 0:
            return
        path = _grad_norm_path(args.ci_save_grad_norm, role, rollout_id, step_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        torch.save(float(grad_norm), tmp)
        os.replace(tmp, path)
    elif args.ci_load_grad_norm:
        path = _grad_norm_path(args.ci_load_grad_norm, role, rollout_id, step_id)
        if not os.path.isfile(path):
            raise CICheckError(f"--ci-load-grad-norm: {path} does not exist; record it first with --ci-save-grad-norm")
        expected = float(torch.load(path, weights_only=True))
        if not math.isclose(grad_norm, expected, rel_tol=0.01, abs_tol=0.01):
            raise CICheckError(f"--ci-load-grad-norm: rollout {rollout_id} step {step_id}'s grad norm {grad_norm:.6g} "
                               f"differs from the recorded {expected:.6g} ({path})")
