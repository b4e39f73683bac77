"""DP shards for upstream's train-dump payload (slime/observability/train_data_utils.py `_build_dump_payload`; here
`train_dump_payload`), shared by record_upstream_train_dump_cases.py and tests/test_upstream_train_dump.py.
Tensors travel as {"tensor": values, "dtype": name}; tuples as {"tuple": items}."""

from __future__ import annotations

import torch


def t(values, dtype="float32"):
    return {"tensor": values, "dtype": dtype}


def shard(rank, dp_rank, **data):
    return {"rank": rank, "data_parallel_rank": dp_rank, "rollout_data": data}


FULL = [shard(0, 0, response_lengths=[2, 3], total_lengths=[5, 7], sample_indices=[7, 2], partition=[3, 0],
              log_probs=[t([0.5, -1.0]), t([0.25, 0.0, -2.0])], rewards=[1.0, 0.0], loss_masks=[t([1, 1], "int64"),
              t([1, 0, 1], "int64")], micro_batch_indices=[[0, 1]], num_microbatches=[1], global_batch_sizes=[4],
              raw_reward=[1.0, 0.0, 1.0, 0.5], max_seq_lens=[7], advantages=t([[0.5, 0.5], [1.0, 1.0]])),
        shard(2, 1, response_lengths=[1, 1], total_lengths=[3, 4], sample_indices=[5, 9], partition=[2, 1],
              log_probs=[t([-0.5]), t([-0.75])], rewards=[1.0, 0.5], loss_masks=[t([1], "int64"), t([0], "int64")],
              micro_batch_indices=[[1, 0]], num_microbatches=[1], global_batch_sizes=[4],
              raw_reward=[9.0], max_seq_lens=[4], advantages=t([[0.25], [0.75]]))]
CASES = {
    "partition_order": FULL,
    "sample_index_order": [shard(1, 0, response_lengths=[1, 2], sample_indices=[4, 1], partition=None,
                                 rewards=[0.0, 1.0], scalar=3),
                           shard(3, 1, response_lengths=[1], sample_indices=[0], rewards=[0.5],
                                 tuple_field={"tuple": [t([1.0])]})],
    "gather_order": [shard(0, 0, response_lengths=[2, 1], rewards=[0.0, 1.0]),
                     shard(1, 1, response_lengths=[1], rewards=[2.0], sample_indices=[None])],
    "partial_ids": [shard(0, 0, response_lengths=[1, 1], sample_indices=[None, 3], partition=[1, 0],
                          rewards=t([0.5, 1.5]), empty=t([]))],
    "no_samples": [shard(0, 0, response_lengths=[], rewards=[])],
}


def decode(x):
    if isinstance(x, dict) and "tensor" in x:
        return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"]))
    if isinstance(x, dict) and "tuple" in x:
        return tuple(decode(v) for v in x["tuple"])
    if isinstance(x, dict):
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


def encode(x):
    if torch.is_tensor(x):
        return {"tensor": x.tolist(), "dtype": str(x.dtype).split(".")[1]}
    if isinstance(x, tuple):
        return {"tuple": [encode(v) for v in x]}
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [encode(v) for v in x]
    return x


def run_all(build_payload) -> dict:
    return {name: encode(build_payload(decode(shards), rollout_id=i, writer_rank=shards[0]["rank"]))
            for i, (name, shards) in enumerate(CASES.items())}
