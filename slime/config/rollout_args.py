"""The rollout configuration's public names (upstream-style import path, used by tests and scripts):
the flags and their validation live in `slime.config.rollout_flags`; `rollout_defaults` is here because it
needs the whole train.py parser (`slime.config.arguments`, which itself imports rollout_flags), so no module
of the configuration imports this one back."""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.arguments import build_parser
from slime.config.rollout_flags import (ROLLOUT_ENGINES, SGLANG_FLAGS, SGLANG_PASSTHROUGH, RolloutArgumentError,
                                        add_rollout_arguments, apply_custom_config, eval_datasets,
                                        request_concurrency, sglang_passthrough, validate_rollout_args)

__all__ = ["ROLLOUT_ENGINES", "SGLANG_FLAGS", "SGLANG_PASSTHROUGH", "RolloutArgumentError", "add_rollout_arguments",
           "apply_custom_config", "eval_datasets", "request_concurrency", "rollout_defaults", "sglang_passthrough",
           "validate_rollout_args"]


def rollout_defaults(**overrides: Any) -> argparse.Namespace:
    """A Namespace with every train.py flag at its default, unvalidated (tests, scripts), updated by `overrides`."""
    ns = build_parser().parse_args([])
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns
