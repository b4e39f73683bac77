"""Upstream slime's import path for the command line (`from slime.utils.arguments import parse_args`).

The parser lives in `slime.config.arguments`; scripts and plugins written for upstream import it from here
and call it upstream's way, `parse_args(add_custom_arguments=None)` (sys.argv; the hook adds flags).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from slime.config.arguments import parse_args as _parse_args


def parse_args(add_custom_arguments: Callable | Sequence[str] | None = None,
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`add_custom_arguments(parser) -> parser` registers a plugin's flags; `argv` defaults to sys.argv[1:].
    A list as the first argument is taken as argv (this project's own callers)."""
    if add_custom_arguments is not None and not callable(add_custom_arguments):
        add_custom_arguments, argv = None, add_custom_arguments
    return _parse_args(argv, add_custom_arguments=add_custom_arguments)


__all__ = ["parse_args"]
