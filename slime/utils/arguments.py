"""Upstream slime's import path for the command line (`from slime.utils.arguments import parse_args`).

The parser lives in `slime.config.arguments`; scripts and plugins written for upstream import it from here.
"""

from slime.config.arguments import parse_args

__all__ = ["parse_args"]
