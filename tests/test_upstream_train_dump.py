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
from train_dump_cases import CASES, TRAINER_BATCH, TRAINER_GLOBAL_BATCH_SIZE, decode, encode, run_all  # noqa: E402

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


def _trainer_batch():
    from slime.backends.megatron import data as D

    b = TRAINER_BATCH
    return D.RolloutBatch(tokens=b["tokens"], response_lengths=b["response_lengths"], rewards=b["rewards"],
                          loss_masks=b["loss_masks"], rollout_log_probs=b["rollout_log_probs"],
                          old_log_probs=[torch.tensor(v) for v in b["old_log_probs"]],
                          advantages=[torch.tensor(v) for v in b["advantages"]])


def test_trainer_dump_file_is_upstreams_layout(tmp_path):
    """The project's own --save-debug-train-data writer (slime.backends.megatron.train_dump): each DP rank's fields
    under upstream's rollout_data names and dtypes, and the file equals what upstream's `_build_dump_payload` made
    of those shards (keys, shapes, dtypes, file name)."""
    from slime.backends.megatron import data as D
    from slime.backends.megatron import train_dump

    batch, dp_size = _trainer_batch(), 2
    steps = D.step_indices(len(batch), TRAINER_GLOBAL_BATCH_SIZE)
    shards = []
    for dp_rank in range(dp_size):
        mine = [i for step in steps for i in D.dp_shard(step, dp_rank, dp_size)]
        shards.append({"rank": dp_rank, "data_parallel_rank": dp_rank,
                       "rollout_data": train_dump.shard_rollout_data(batch, mine, TRAINER_GLOBAL_BATCH_SIZE)})
    assert encode(shards) == CASES["trainer_batch"]  # the recorded upstream input is what the trainer hands over
    path = train_dump.save_train_data(str(tmp_path / "train_data" / "{rollout_id}.pt"), 5, 0, shards)
    assert path == str(tmp_path / "train_data" / "5.pt") and os.listdir(tmp_path / "train_data") == ["5.pt"]
    saved = torch.load(path, weights_only=True)
    want = dict(RECORD["cases"]["trainer_batch"], rollout_id=5)
    assert encode(saved) == want
    assert [s["rollout_position"] for s in saved["samples"]] == [0, 1, 2, 3]
    assert saved["samples"][2]["tokens"].dtype == torch.int64 and saved["samples"][2]["loss_masks"].dtype == torch.int32


def test_trainer_dump_on_one_rank(tmp_path):
    from slime.backends.megatron import train_dump

    args = SimpleNamespace(save_debug_train_data=str(tmp_path / "{rollout_id}-{rank}.pt"),
                           global_batch_size=TRAINER_GLOBAL_BATCH_SIZE)
    path = train_dump.dump(args, _trainer_batch(), [0, 1, 2, 3], 3, rank=0, dp_rank=0, dp_size=1, dp_group=None,
                           writes=True)
    saved = torch.load(path, weights_only=True)
    assert path.endswith("3-0.pt") and saved["dp_shards"][0]["partition"] == [0, 1, 2, 3]
    assert [float(s["log_probs"][-1]) for s in saved["samples"]] == [-1.0, -2.25, -0.75, -1.5]
    assert saved["raw_reward"] == TRAINER_BATCH["rewards"] and "samples" not in saved["dp_shards"][0]
    assert train_dump.dump(args, _trainer_batch(), [0], 3, rank=1, dp_rank=0, dp_size=1, dp_group=None,
                           writes=False) is None
