"""Upstream's debug split / replay and fault-tolerance flags (docs/training.md, "Debug split and replay" and
"Fault tolerance"); `apply_debug_modes` fills what they imply, before placement is decided."""

from __future__ import annotations

import argparse

from slime.config.parser_helpers import ArgumentError, add_argument_once as _add


def add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug split and replay", "run the rollout side or the trainer side alone, and "
                                  "replay saved rollouts (upstream's flags)")
    _add(g, parser, "--debug-rollout-only", action="store_true",
         help="engines and rollouts only: no trainer rank starts, nothing is trained or synced (with "
              "--save-debug-rollout-data: record rollouts to replay)")
    _add(g, parser, "--save-debug-rollout-data", type=str, default=None,
         help="save each rollout's samples (after rewards) to PATH.format(rollout_id=N); evaluations to "
              "rollout_id='eval_N'. Format: torch.save({'rollout_id', 'samples': [Sample.to_dict()]})")
    _add(g, parser, "--load-debug-rollout-data", type=str, default=None,
         help="replay: rollout N's samples come from PATH.format(rollout_id=N) instead of the engines; implies "
              "--debug-train-only (files are read with torch.load(weights_only=True))")
    _add(g, parser, "--load-debug-rollout-data-subsample", type=float, default=None,
         help="replay only this fraction of each saved rollout (half from its start, half from its end)")

    g = parser.add_argument_group("fault tolerance", "a health-check loop over the rollout engines while they "
                                  "generate: an engine that does not answer is stopped, restarted and re-synced")
    _add(g, parser, "--use-fault-tolerance", action="store_true",
         help="check every engine's /health_generate while rollouts and evaluations run")
    _add(g, parser, "--rollout-health-check-interval", type=float, default=30.0,
         help="seconds between health-check rounds")
    _add(g, parser, "--rollout-health-check-timeout", type=float, default=30.0,
         help="seconds an engine may take to answer before it is stopped and restarted")
    _add(g, parser, "--rollout-health-check-first-wait", type=float, default=0.0,
         help="grace period (seconds) after each rollout starts before the first check (model warm-up)")


def apply_debug_modes(args: argparse.Namespace, world: int) -> None:
    """Before placement: --load-debug-rollout-data implies --debug-train-only (upstream's rule); --debug-rollout-only
    gives the engines the devices (the trainer takes none: no colocation, no offload, no weight sync)."""
    from slime.rollout.debug_data import DebugDataError, rollout_path

    for flag in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(args, flag)
        if template is not None:
            try:
                rollout_path(template, 0)
            except DebugDataError as e:
                raise ArgumentError(str(e).replace("debug rollout path", f"--{flag.replace('_', '-')}")) from None
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    if args.debug_train_only:
        args.eval_interval = None  # no engine to evaluate with (upstream's eval returns at once)
    if args.debug_rollout_only and args.debug_train_only:
        raise ArgumentError("--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data, which implies "
                            "it) exclude each other: pass one")
    sub = args.load_debug_rollout_data_subsample
    if sub is not None and not (0 < sub <= 1 and args.load_debug_rollout_data is not None):
        raise ArgumentError(f"--load-debug-rollout-data-subsample {sub}: needs --load-debug-rollout-data and a "
                            "fraction in (0, 1]")
    if args.debug_rollout_only:
        if args.colocate and args.rollout_num_gpus is None:
            args.rollout_num_gpus = world  # the devices the trainer would have shared
        args.colocate = False
        args.offload = False
        args.offload_train = args.offload_rollout = False
        if args.update_weight_mode == "ipc":
            args.update_weight_mode = "auto"  # nothing is synced
    for flag in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    if args.rollout_health_check_first_wait < 0:
        raise ArgumentError(f"--rollout-health-check-first-wait must be >= 0, got {args.rollout_health_check_first_wait}")
