"""Set-up errors at the command line: one line, no traceback.

An unmet device request (`AcceleratorUnavailable`) or a patch set that no longer matches its library
(`PatchError`) is a configuration problem whose message already names the cause and the fix. The
entry points (`python train.py`, `python -m slime.accelerator`, the embedded engine) wrap their main
in `one_line_errors`, which prints "slime: <message>" to stderr and exits 2; nothing replaces
`sys.excepthook`, so library users keep their own error handling. `SLIME_DEBUG=1` re-raises.
Errors raised in a Ray worker arrive wrapped; the worker's original exception is reported.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

from slime.accelerator.base import AcceleratorUnavailable
from slime.accelerator.patches import PatchError

SETUP_ERRORS = (AcceleratorUnavailable, PatchError)
EXIT_CODE = 2
F = TypeVar("F", bound=Callable[..., int | None])


def setup_error(exc: BaseException) -> BaseException | None:
    """The set-up error behind `exc`: a Ray task error's cause, `exc` itself or its __cause__; else None."""
    for candidate in (getattr(exc, "cause", None), exc, exc.__cause__):
        if isinstance(candidate, SETUP_ERRORS):
            return candidate
    return None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"slime: {text[0] if text else type(exc).__name__}"


def one_line_errors(main: F) -> F:
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:
            err = setup_error(e)
            if err is None or os.environ.get("SLIME_DEBUG"):
                raise
            print(one_line(err), file=sys.stderr, flush=True)
            return EXIT_CODE

    return wrapper  # type: ignore[return-value]
