"""What every flag module of slime.config shares: the one-line error, the add-once helper, and the two ways a
check fails (an error, or a warning under --dry-run). A leaf: it imports nothing of slime, so every module of
the configuration can use it and none has to import `slime.config.arguments` (which imports them all) back."""

from __future__ import annotations

import argparse


class ArgumentError(ValueError):
    """A bad combination of flags. The message is one line: the problem and the fix."""


def add_argument_once(group, parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """`group.add_argument(flag, ...)` unless `parser` already has `flag`: the cluster and rollout groups
    both list a few shared flags (e.g. --rollout-num-gpus), and the first definition wins."""
    if flag not in parser._option_string_actions:
        group.add_argument(flag, **kwargs)


def require(cond: bool, msg: str) -> None:
    """An ArgumentError with `msg` unless `cond`."""
    if not cond:
        raise ArgumentError(msg)


def limit(args: argparse.Namespace, cond: bool, msg: str) -> None:
    """Valid for upstream slime but not runnable by this trainer yet: an error, or a warning under --dry-run
    (which plans a run for a target cluster; `args.dry_run_limits` collects them)."""
    if cond:
        return
    if args.dry_run:
        args.dry_run_limits.append(msg)
    else:
        raise ArgumentError(msg)
