"""Ascend op implementations (provider for the "npu" accelerator). Filled in per op; until then the
reference runs."""

from __future__ import annotations


def resolve(op_name: str, acc):
    return None
