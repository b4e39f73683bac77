"""slime.observability.train_data_utils.restore_context_parallel_fields_to_cpu against upstream's on the same
inputs (tests/data/upstream_train_data_utils_cases.json, recorded by
tests/data/record_upstream_train_data_utils_cases.py from upstream's file at the commit it names): the restored
copy (values, dtypes, containers), None on a rank that does not keep it, and the refusals; plus a gather call
count showing every rank takes part in the same collectives whether it keeps the result or not."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from slime.observability.train_data_utils import CONTEXT_PARALLEL_FIELDS, restore_context_parallel_fields_to_cpu

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_train_data_utils_cases.json")) as f:
    RECORD = json.load(f)


def gather(value, total_length, response_length):  # the recording's stand-in for all_gather_with_cp
    return torch.cat([value, value + 100])[:response_length]


def short_gather(value, total_length, response_length):
    return value[: max(response_length - 1, 0)]


def encode(x):
    if torch.is_tensor(x):
        return {"tensor": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        return {"dict": {k: encode(v) for k, v in x.items()}}
    if isinstance(x, tuple):
        return {"tuple": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    return x


def decode(x):
    if isinstance(x, dict) and "tensor" in x:
        return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"].split(".")[1]))
    if isinstance(x, dict) and "dict" in x:
        return {k: decode(v) for k, v in x["dict"].items()}
    if isinstance(x, dict) and "tuple" in x:
        return tuple(decode(v) for v in x["tuple"])
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: f"{sorted(c['rollout_data'])}-{c['keep_restored']}")
def test_restore_matches_upstream(case):
    data = {k: decode(v) for k, v in case["rollout_data"].items()}
    fn = gather if case["gather"] == "ok" else short_gather
    try:
        out = {"ok": encode(restore_context_parallel_fields_to_cpu(data, fn, keep_restored=case["keep_restored"]))}
    except (ValueError, TypeError) as e:
        out = {"error": [type(e).__name__, str(e)]}
    if "error" in case["out"]:  # same type, same field / sample / lengths in the message
        facts = re.compile(r"'[^']*'|\d+")
        assert out.get("error", [None])[0] == case["out"]["error"][0], out
        assert facts.findall(out["error"][1]) == facts.findall(case["out"]["error"][1])
    else:
        assert out == case["out"]


def test_every_rank_gathers_the_same_tensors_and_the_input_is_untouched():
    data = {"total_lengths": [6, 3], "response_lengths": [3, 1], "tokens": [torch.arange(6), torch.arange(3)],
            "log_probs": [torch.randn(2), torch.randn(1)], "advantages": (torch.randn(2), torch.randn(1))}
    calls = {True: [], False: []}
    for keep in (True, False):
        def counting(value, total, response, keep=keep):
            calls[keep].append((total, response))
            return gather(value, total, response)
        out = restore_context_parallel_fields_to_cpu(data, counting, keep_restored=keep)
        assert (out is None) is (not keep)
    assert calls[True] == calls[False] == [(6, 3), (3, 1)] * 2
    assert [t.shape[0] for t in data["log_probs"]] == [2, 1]  # shards left as they were
    assert set(CONTEXT_PARALLEL_FIELDS) >= {"log_probs", "advantages", "entropy"}
