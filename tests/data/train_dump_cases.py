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
# A trainer batch (the RolloutBatch of TRAINER_BATCH, --global-batch-size 2, two DP ranks taking every other
# sample of each step) as slime.backends.megatron.train_dump hands each DP rank's fields to the payload: upstream's
# rollout_data names and dtypes (tokens int64, loss_masks int32, per-token fields float32).
TRAINER_BATCH = {"tokens": [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], "response_lengths": [2, 1, 3, 1],
                 "rewards": [1.0, 0.0, 0.5, -1.0], "loss_masks": [[1, 1], [0], [1, 0, 1], [1]],
                 "rollout_log_probs": [[-0.5, -1.25], [-2.0], [-0.25, -3.0, -0.75], [-1.5]],
                 "old_log_probs": [[-0.5, -1.0], [-2.25], [-0.25, -2.75, -0.75], [-1.5]],
                 "advantages": [[0.5, 0.5], [-0.5], [1.0, 1.0, 1.0], [-1.0]]}
TRAINER_GLOBAL_BATCH_SIZE = 2


def _trainer_shard(rank, dp_rank, picks):
    b = TRAINER_BATCH

    def per_token(key):
        return [t(b[key][i]) for i in picks]

    return shard(rank, dp_rank, partition=picks, tokens=[t(b["tokens"][i], "int64") for i in picks],
                 response_lengths=[b["response_lengths"][i] for i in picks],
                 rewards=[b["rewards"][i] for i in picks],
                 loss_masks=[t(b["loss_masks"][i], "int32") for i in picks],
                 total_lengths=[len(b["tokens"][i]) for i in picks], raw_reward=b["rewards"],
                 local_raw_reward=[b["rewards"][i] for i in picks], global_batch_sizes=[2, 2],
                 rollout_log_probs=per_token("rollout_log_probs"), log_probs=per_token("old_log_probs"),
                 advantages=per_token("advantages"))


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
    "trainer_batch": [_trainer_shard(0, 0, [0, 2]), _trainer_shard(1, 1, [1, 3])],
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
