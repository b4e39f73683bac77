"""The accelerator's policy on the parsed arguments (`check_and_update_config`: refuse what the device cannot do,
set what it decides for the run, e.g. each CPU worker's share of the cores), applied once per run on the driver,
before Ray starts.

train.py's preparation applies it right after preflight (a refusal is one line, exit 2); `slime.train.train(args)`
and `slime.train_async.train(args)` apply it for arguments handed to them directly (tests, programs embedding
a run) and find it already applied otherwise. `args.device_policy` records the accelerator whose policy the
arguments carry.
"""

from __future__ import annotations


def apply_device_policy(args) -> None:
    """Apply the current accelerator's policy to `args` unless they already carry it. Raises
    slime.accelerator.DeviceConfigError (one line: the flag and the fix)."""
    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    if vars(args).get("device_policy") == acc.name:  # (not a flag: set here once the policy is applied)
        return
    acc.check_and_update_config(args)
    args.device_policy = acc.name
