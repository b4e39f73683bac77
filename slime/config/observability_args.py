"""Upstream slime's extra rollout metrics and CI-check flags, with upstream's names and meaning.

The metrics are computed by `slime.rollout.rollout_metrics` (on the rollout manager, from the samples) and the
trainer-side checks by `slime.backends.megatron.ci_checks`; `--wandb-always-use-train-step` is read by
`slime.utils.tracking`.
"""

from __future__ import annotations

import argparse

from slime.config.parser_helpers import ArgumentError, add_argument_once as _add


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


PROFILE_TARGETS = ("train_overall", "train_actor", "train_log_probs")


def add_profiler_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's profiler flags (--use-pytorch-profiler, --profile-step-start/-end, --record-memory-history,
    --memory-snapshot-path) and upstream slime's targets for them (slime.backends.megatron.profiler)."""
    g = parser.add_argument_group("profiling (torch.profiler traces, device memory history)")
    _add(g, parser, "--use-pytorch-profiler", action="store_true",
         help="write torch.profiler traces (TensorBoard format, gzip) to --tensorboard-dir for each --profile-target")
    _add(g, parser, "--profile-step-start", type=int, default=10, help="first profiled step of each target")
    _add(g, parser, "--profile-step-end", type=int, default=12, help="profiling stops before this step")
    _add(g, parser, "--profile-ranks", type=int, nargs="+", default=[0], help="trainer ranks that profile")
    _add(g, parser, "--profile-target", choices=PROFILE_TARGETS, nargs="+", default=["train_overall"],
         help="what a profiler step is: a rollout's whole training (train_overall), one optimizer step "
              "(train_actor), one log-prob pass (train_log_probs)")
    _add(g, parser, "--record-memory-history", action="store_true",
         help="record the device allocator's history from start-up and dump it (and on an out-of-memory error) "
              "to --memory-snapshot-dir; on a device without one (CPU) a warning")
    _add(g, parser, "--memory-snapshot-path", type=str, default="snapshot.pickle",
         help="file name of the memory snapshot (prefixed with the time and the rank)")
    _add(g, parser, "--memory-snapshot-dir", type=str, default=".", help="directory of the memory snapshot")
    _add(g, parser, "--memory-snapshot-num-steps", type=int, default=None,
         help="dump the memory history after this many rollouts (default: only on an out-of-memory error)")
    _add(g, parser, "--memory-recorder", choices=("torch", "memray"), default="torch",
         help="torch: the device allocator's history; memray: host allocations (needs the memray package and "
              "--memory-snapshot-num-steps)")


def validate_profiler_args(args: argparse.Namespace) -> None:
    if args.use_pytorch_profiler and args.profile_step_end <= args.profile_step_start:
        raise ArgumentError(f"--profile-step-end {args.profile_step_end} must be greater than --profile-step-start "
                            f"{args.profile_step_start}")
    if args.use_pytorch_profiler and "train_overall" in args.profile_target and len(set(args.profile_target)) > 1:
        raise ArgumentError(f"--profile-target {' '.join(args.profile_target)}: train_overall spans the other "
                            "targets and torch.profiler runs one session at a time; profile train_overall alone")
    if args.record_memory_history and args.memory_recorder == "memray":
        if args.memory_snapshot_num_steps is None:
            raise ArgumentError("--memory-recorder memray needs --memory-snapshot-num-steps (when to stop and write it)")
        import importlib.util

        if importlib.util.find_spec("memray") is None:
            raise ArgumentError("--memory-recorder memray: the memray package is not installed (pip install memray)")


def add_dump_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug dumps")
    _add(g, parser, "--save-debug-train-data", type=str, default=None,
         help="after each rollout's training, one file of what every data-parallel shard trained on (per sample: "
              "tokens, masks, reward, log-probs, advantages, ...); PATH may hold {rollout_id} and {rank} "
              "(slime.backends.megatron.train_dump)")
    _add(g, parser, "--dump-details", type=str, default=None,
         help="DIR: --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt and --save-debug-train-data "
              "DIR/train_data/{rollout_id}.pt")


def apply_dump_details(args: argparse.Namespace) -> None:
    """--dump-details sets both dumps (upstream's: over any given), which must then differ."""
    if args.dump_details is not None:
        args.save_debug_rollout_data = f"{args.dump_details}/rollout_data/{{rollout_id}}.pt"
        args.save_debug_train_data = f"{args.dump_details}/train_data/{{rollout_id}}.pt"
    if args.save_debug_train_data is not None:
        if args.save_debug_train_data == args.save_debug_rollout_data:
            raise ArgumentError("--save-debug-train-data must differ from --save-debug-rollout-data (both would write "
                                "the same files)")
        try:
            args.save_debug_train_data.format(rollout_id=0, rank=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ArgumentError(f"--save-debug-train-data {args.save_debug_train_data!r}: only {{rollout_id}} and "
                                f"{{rank}} may be substituted ({e!r})") from None
