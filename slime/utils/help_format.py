"""`--help` formatting: each option's default shown once, and only when it says something."""

from __future__ import annotations

import argparse


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" like argparse's ArgumentDefaultsHelpFormatter, except when the help text
    already states its default, or the default is None/False (an unset value or an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)
