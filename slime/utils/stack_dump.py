"""Hang diagnosis: SLIME_DUMP_STACKS_AFTER_S=N makes every slime process (the driver, each Ray actor, each
engine) print every thread's Python stack to its stderr once, N seconds after it imported slime. Ray forwards
an actor's stderr to the driver's console, so a run that hangs shows where each of its processes waits.
Off unless set; the dump does not stop the process (faulthandler.dump_traceback_later, exit=False)."""

from __future__ import annotations

import faulthandler
import os
import sys

ENV = "SLIME_DUMP_STACKS_AFTER_S"


def arm_from_env() -> float | None:
    """Arm the dump from $SLIME_DUMP_STACKS_AFTER_S; returns the delay in seconds, None when unset or invalid
    (a bad value is reported on stderr and ignored: a debugging aid never stops a run)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        delay = float(raw)
        if not delay > 0:
            raise ValueError
    except ValueError:
        print(f"slime: ignoring {ENV}={raw!r}: it must be a positive number of seconds", file=sys.stderr)
        return None
    faulthandler.dump_traceback_later(delay, repeat=False, file=sys.stderr, exit=False)
    return delay
