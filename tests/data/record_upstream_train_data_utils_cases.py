"""Records tests/data/upstream_train_data_utils_cases.json: upstream slime's
slime/observability/train_data_utils.py restore_context_parallel_fields_to_cpu, run outside this repository on
the inputs below, with a stand-in gather (each shard repeated to twice its length, cut to the response length,
or a deliberately wrong length):
    git -C UPSTREAM show COMMIT:slime/observability/train_data_utils.py > /tmp/up/train_data_utils.py
    python tests/data/record_upstream_train_data_utils_cases.py /tmp/up/train_data_utils.py COMMIT OUT.json
"""
import json
import sys
import types

import torch

up = sys.modules["up"] = types.ModuleType("up")
exec(open(sys.argv[1]).read(), up.__dict__)


def gather(value, total_length, response_length):
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


def t(values, dtype="float32"):
    return {"tensor": values, "dtype": f"torch.{dtype}"}


BASE = {"total_lengths": [7, 5], "response_lengths": [4, 2], "tokens": [t([1, 2, 3, 4, 5, 6, 7], "int64"),
        t([8, 9, 10, 11, 12], "int64")], "rewards": [1.0, 0.0], "sample_indices": {"tuple": [3, 1]},
        "extra": {"dict": {"mask": t([1, 0], "int32"), "n": 2}}}
INPUTS = [
    ("ok", {**BASE, "log_probs": [t([-0.5, -1.0]), t([-2.0])], "advantages": [t([0.25, 0.5]), t([1.0])],
            "entropy": {"tuple": [t([0.1, 0.2]), t([0.3])]}}),
    ("ok", {**BASE}),
    ("ok", {**BASE, "kl": None, "values": [t([1.0, 2.0]), t([3.0])]}),
    ("ok", {"total_lengths": [], "response_lengths": [], "log_probs": []}),
    ("ok", {**BASE, "total_lengths": [7], "log_probs": [t([-0.5, -1.0]), t([-2.0])]}),
    ("ok", {**BASE, "returns": [t([1.0, 2.0])]}),
    ("ok", {**BASE, "ref_log_probs": t([1.0, 2.0])}),
    ("ok", {**BASE, "teacher_log_probs": [t([1.0, 2.0]), [3.0]]}),
    ("short", {**BASE, "rollout_log_probs": [t([-0.5, -1.0]), t([-2.0])]}),
]
cases = []
for gather_name, data in INPUTS:
    for keep in (True, False):
        fn = gather if gather_name == "ok" else short_gather
        try:
            out = {"ok": encode(up.restore_context_parallel_fields_to_cpu({k: decode(v) for k, v in data.items()}, fn, keep_restored=keep))}
        except (ValueError, TypeError) as e:
            out = {"error": [type(e).__name__, str(e)]}
        cases.append({"fn": "restore_context_parallel_fields_to_cpu", "gather": gather_name, "keep_restored": keep,
                      "rollout_data": data, "out": out})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/observability/train_data_utils.py",
           "recorded_with": "upstream's file run on these inputs (torch only), outside this repository",
           "cases": cases}, open(sys.argv[3], "w"), indent=0)
print(len(cases))
