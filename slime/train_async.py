"""train_async.py: the one-step-off-policy loop (slime.run.one_step_off): while the trainer trains on rollout k,
the engines (on their own devices) already generate rollout k+1 with the weights they hold.

    python train_async.py --hf-checkpoint DIR --rollout-num-gpus N --num-rollout M ...

The command line, start-up, clean-up and exits are train.py's (slime.train.main); the run session is
slime.run.session's; only the loop differs. --colocate is refused: the engines need devices of their own.
"""

from __future__ import annotations

from typing import Any, Sequence

COLOCATE_REFUSED = ("train_async.py: error: --colocate is not supported: the engines generate while the trainer "
                    "trains, so they need devices of their own; pass --rollout-num-gpus N (or use train.py)")


def colocate_refused(args) -> str | None:
    """The one flag this program refuses, checked right after parsing (before preflight and Ray)."""
    return COLOCATE_REFUSED if args.colocate else None


def train(args) -> list[dict[str, Any]]:
    """Run the loop (--debug-rollout-only: rollouts only); returns the per-iteration metric records (also in
    OUTPUT_DIR/metrics.jsonl)."""
    from slime.config.device_policy import apply_device_policy
    from slime.run import one_step_off, rollout_only
    from slime.run.launch import launch

    if args.colocate:
        raise ValueError(COLOCATE_REFUSED.split("error: ", 1)[1])
    apply_device_policy(args)  # a no-op after main()'s preparation; args handed in directly get it here
    return launch(args, rollout_only.run if args.debug_rollout_only else one_step_off.run)


def main(argv: Sequence[str] | None = None) -> int:
    """As slime.train.main (same exit statuses, --dry-run included), with the one-step-off-policy loop."""
    from slime.train import main as command_line

    return command_line(argv, train_fn=train, refuse=colocate_refused)


if __name__ == "__main__":
    from slime.utils.exits import end_entry_point

    end_entry_point(main())
