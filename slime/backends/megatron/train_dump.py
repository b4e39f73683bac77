"""--save-debug-train-data PATH (upstream's): after each rollout's training, one file with what every
data-parallel shard trained on. PATH may hold {rollout_id} and {rank} (the writer's global rank). --dump-details DIR
sets it to DIR/train_data/{rollout_id}.pt (and the rollout dump to DIR/rollout_data/{rollout_id}.pt).

The file is upstream's (slime.observability.train_data_utils.train_dump_payload, equal to upstream's
`_build_dump_payload`), built from each DP rank's training fields under upstream's rollout_data names:
    {"format_version": 2, "rollout_id", "rank", "raw_reward": [every sample's reward, rollout order],
     "samples": [{"data_parallel_rank", "rollout_position", "tokens" (int64), "response_lengths",
                  "rewards", "loss_masks" (int32), "total_lengths", "local_raw_reward",
                  "rollout_log_probs", "log_probs", "ref_log_probs", "advantages", "values", "teacher_log_probs",
                  "entropy" (float32 over the response tokens; each only when the run has it)}, ...],
     "dp_shards": [{"rank", "data_parallel_rank", "sample_indices": None, "partition": [rollout positions],
                    "global_batch_sizes"}, ...]}
read back with torch.load(path, weights_only=True). Samples are in rollout order (`rollout_position`, upstream's
`partition`). Differences in values, not layout: `rewards` are the rewards the advantages were computed from (this
project normalizes groups in its advantage step, upstream's dump holds its post-processed rewards); the trainer's
batch carries no `Sample.index`, so `sample_indices` is None (upstream's layout for a rollout without indices);
`num_microbatches` / `micro_batch_indices` are not recorded. `log_probs` are the old policy's, from the training
forward itself when that forward's log-probs served as the old ones.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from slime.backends.megatron import data as D
from slime.observability.train_data_utils import train_dump_payload

# the trainer batch's per-token fields under upstream's rollout_data names
_PER_TOKEN = {"rollout_log_probs": "rollout_log_probs", "old_log_probs": "log_probs",
              "ref_log_probs": "ref_log_probs", "advantages": "advantages", "values": "values",
              "teacher_log_probs": "teacher_log_probs", "entropy": "entropy"}


def _floats(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1).clone()


def shard_rollout_data(batch: D.RolloutBatch, indices: Sequence[int], global_batch_size: int) -> dict[str, Any]:
    """One DP rank's fields as upstream's rollout_data holds them after training (dtypes included)."""
    data: dict[str, Any] = {
        "partition": [int(i) for i in indices],
        "tokens": [torch.tensor(list(map(int, batch.tokens[i])), dtype=torch.long) for i in indices],
        "response_lengths": [int(batch.response_lengths[i]) for i in indices],
        "rewards": [float(batch.rewards[i]) for i in indices],
        "loss_masks": [torch.tensor(list(map(int, batch.loss_masks[i])), dtype=torch.int) for i in indices],
        "total_lengths": [len(batch.tokens[i]) for i in indices],
        "raw_reward": [float(r) for r in batch.rewards],  # whole rollout, as upstream ships it to every rank
        "local_raw_reward": [float(batch.rewards[i]) for i in indices],
        # upstream's: rollouts per step (the samples per step when each rollout is one sample)
        "global_batch_sizes": [global_batch_size] * len(D.batch_steps(batch, global_batch_size)),
    }
    for field, name in _PER_TOKEN.items():
        values = getattr(batch, field)
        if values is not None and all(values[i] is not None for i in indices):
            data[name] = [_floats(values[i]) for i in indices]
    return data


def save_train_data(template: str, rollout_id: int, writer_rank: int, shards: list[dict[str, Any]]) -> str:
    """`shards`: upstream's gathered DP shards ({"rank", "data_parallel_rank", "rollout_data"})."""
    path = template.format(rollout_id=rollout_id, rank=writer_rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(train_dump_payload(shards, rollout_id=rollout_id, writer_rank=writer_rank), tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def dump(args, batch, mine: Sequence[int], rollout_id: int, *, rank: int, dp_rank: int, dp_size: int, dp_group,
         writes: bool) -> str | None:
    """Collective over the data-parallel group when `writes` (the last pipeline stage's TP/CP rank 0 of each
    DP rank: they hold the computed fields); DP rank 0 of them writes the file. Returns its path there."""
    if not args.save_debug_train_data or not writes:
        return None
    local = {"rank": rank, "data_parallel_rank": dp_rank,
             "rollout_data": shard_rollout_data(batch, mine, args.global_batch_size)}
    if dp_size == 1:
        shards = [local]
    else:
        import torch.distributed as dist

        shards = [None] * dp_size if dp_rank == 0 else None
        dist.gather_object(local, shards, dst=dist.get_global_rank(dp_group, 0), group=dp_group)
    if dp_rank != 0:
        return None
    return save_train_data(args.save_debug_train_data, rollout_id, rank, shards)
