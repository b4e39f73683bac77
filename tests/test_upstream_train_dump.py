"""Upstream's save_debug_train_data (slime.observability.train_data_utils): its file layout (`train_dump_payload`)
equals upstream's `_build_dump_payload` on recorded DP shards (tests/data/train_dump_cases.py, recorded by
tests/data/record_upstream_train_dump_cases.py at the commit it names): rollout order by partition, then sample
index, then gather order; layout and non-per-sample fields per shard; whole-batch fields once. And the writer itself
on one rank (Megatron parallel state over a one-process gloo group): the file it writes is that payload."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from slime.observability.train_data_utils import save_debug_train_data, train_dump_payload

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from train_dump_cases import CASES, decode, encode, run_all  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_train_dump_cases.json")) as f:
    RECORD = json.load(f)


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert sorted(RECORD["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_payload_equals_upstream(name):
    assert run_all(train_dump_payload)[name] == RECORD["cases"][name]


def test_writer_on_one_rank_writes_the_payload(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    data = decode(CASES["partition_order"][0]["rollout_data"])
    del data["advantages"]  # CP-sharded fields are per-sample lists in a real batch (this case's is a tensor)
    args = SimpleNamespace(save_debug_train_data=str(tmp_path / "dump" / "train_{rollout_id}_{rank}.pt"))
    save_debug_train_data(args, rollout_id=4, rollout_data=data)
    saved = torch.load(tmp_path / "dump" / "train_4_0.pt", weights_only=False)
    want = train_dump_payload([{"rank": 0, "data_parallel_rank": 0, "rollout_data": data}], rollout_id=4, writer_rank=0)
    assert encode(saved) == encode(want) and [s["rollout_position"] for s in saved["samples"]] == [0, 3]
    save_debug_train_data(SimpleNamespace(save_debug_train_data=None), rollout_id=5, rollout_data=data)
    assert sorted(os.listdir(tmp_path / "dump")) == ["train_4_0.pt"]
