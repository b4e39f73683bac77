"""Upstream slime's extra rollout metrics and CI-check flags, with upstream's names and meaning.

The metrics are computed by `slime.rollout.rollout_metrics` (on the rollout manager, from the samples) and the
trainer-side checks by `slime.backends.megatron.ci_checks`; `--wandb-always-use-train-step` is read by
`slime.utils.tracking`.
"""

from __future__ import annotations

import argparse

from slime.config.arguments import add_argument_once as _add


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout metrics (upstream's optional ones)")
    _add(g, parser, "--log-passrate", action="store_true",
         help="log pass@k (k = 1, 2, 4, ... up to --n-samples-per-prompt) of every prompt group: passrate/pass@k "
              "(unbiased estimator over the group; a sample passes when its raw reward is 1)")
    _add(g, parser, "--log-multi-turn", action="store_true",
         help="log response lengths with and without tool/observation tokens (loss mask 0) and the rounds per "
              "sample (metadata 'round_number'): multi_turn/...")
    _add(g, parser, "--log-reward-category", type=str, default=None,
         help="the key of a dict reward holding a category (e.g. why it failed): rollout/error_cat/<category> is "
              "the share of samples in each")
    _add(g, parser, "--log-correct-samples", action="store_true",
         help="log the length quartiles (of --rollout-max-response-len) and the mean -log-prob of the samples "
              "whose raw reward is 1: rollout/correct_length/p25..p100, rollout/correct_entropy")
    _add(g, parser, "--wandb-always-use-train-step", action="store_true",
         help="trackers (wandb, TensorBoard) step every record by the optimizer steps taken so far instead of the "
              "rollout count")

    g = parser.add_argument_group("CI checks (upstream's; assertions on a run's numbers)")
    _add(g, parser, "--ci-test", action="store_true",
         help="fail the run when a number is off: trainer/engine log-prob mismatch over "
              "--ci-train-rollout-logprob-abs-diff-threshold, a first step whose KL to the reference (kl loss, "
              "ppo_kl) is not ~0, rollout log-probs outside (-1, 0)")
    _add(g, parser, "--ci-disable-kl-checker", action="store_true", help="--ci-test without the first-step KL checks")
    _add(g, parser, "--ci-train-rollout-logprob-abs-diff-threshold", type=float, default=0.1,
         help="--ci-test's bound on train_rollout_logprob_abs_diff")
    _add(g, parser, "--ci-save-grad-norm", type=str, default=None,
         help="save each step's grad norm to this path template ({role}, {rollout_id}, {step_id})")
    _add(g, parser, "--ci-load-grad-norm", type=str, default=None,
         help="compare each step's grad norm with the one saved at this path template (rel/abs tolerance 0.01)")
