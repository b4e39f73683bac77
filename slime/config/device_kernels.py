"""Before Ray: print which implementation serves each op of the model on this device, and refuse to start under
--require-device-kernels when any would fall back to the pure-torch reference (slime.accelerator.op_report).

The table is the one the trainer ranks build: same accelerator, same providers, same start-up probes (run once
here on this process's device, on inputs of a few hundred elements)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from slime.config.preflight_report import PreflightError


def add_device_kernel_arguments(group: argparse._ArgumentGroup, parser: argparse.ArgumentParser) -> None:
    if "--require-device-kernels" not in parser._option_string_actions:
        group.add_argument("--require-device-kernels", action="store_true",
                           help="refuse to start (exit 2, before Ray) when any op the model uses would run on the "
                                "pure-torch reference instead of a device kernel on this accelerator (the op table "
                                "printed at start says which)")


def model_family(hf_config: dict | None) -> str | None:
    """The registry family serving config.json's model_type (None when there is no config or no family)."""
    if not hf_config:
        return None
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    try:
        return get_family(hf_config.get("model_type")).name
    except UnsupportedModelError:
        return None


def fp8_checkpoint(hf_config: dict | None) -> bool:
    """config.json states block-FP8 weights (quantization_config quant_method "fp8")."""
    from slime.utils.fp8_blocks import Fp8BlockFormat, Fp8FormatError

    try:
        return bool(hf_config) and Fp8BlockFormat.from_config(hf_config) is not None
    except Fp8FormatError:  # a format the reader refuses: validation reports it
        return False


def check_device_kernels(args: Any, acc: Any) -> list[str]:
    """The op table of this run's model on `acc` as lines (printed by the caller); PreflightError (one line
    naming the ops) when --require-device-kernels is set and any op would fall back."""
    from slime.accelerator import op_report

    family = model_family(args.hf_config)  # config.json as validation read it
    rows = op_report.op_rows(acc.ops, op_report.model_ops(family, fp8_checkpoint(args.hf_config)))
    lines = op_report.format_table(acc.name, family, rows, has_kernels=type(acc).op_provider is not None)
    if args.require_device_kernels:
        refused = op_report.refusal(acc.name, family, rows)
        if refused:
            print("\n".join(lines), file=sys.stderr, flush=True)
            raise PreflightError(refused)
    return lines
