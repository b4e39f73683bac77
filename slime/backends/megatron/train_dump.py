"""--save-debug-train-data PATH (upstream's): after each rollout's training, one file with what every
data-parallel shard trained on, in the rollout's sample order. PATH may hold {rollout_id} and {rank} (the
writer's global rank). --dump-details DIR sets it to DIR/train_data/{rollout_id}.pt (and the rollout dump to
DIR/rollout_data/{rollout_id}.pt).

The file (torch.save; read back with torch.load(path, weights_only=True)):
    {"format_version": 2, "rollout_id": int, "rank": int, "dp_shards": [{"data_parallel_rank", "samples"}],
     "samples": [{"sample_index", "data_parallel_rank", "tokens", "response_length", "reward", "loss_mask",
                  "log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "values"}, ...]}
Per-token fields are float32 tensors over the response tokens (absent when the run has none). `log_probs` are
the old policy's, from the training forward itself when that forward's log-probs served as the old ones.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

FORMAT_VERSION = 2
_PER_TOKEN = ("old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "values")
_NAMES = {"old_log_probs": "log_probs"}


def _tensor(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1).clone()


def shard_samples(batch, indices: Sequence[int], dp_rank: int) -> list[dict[str, Any]]:
    out = []
    for i in indices:
        sample = {"sample_index": int(i), "data_parallel_rank": dp_rank, "tokens": list(map(int, batch.tokens[i])),
                  "response_length": int(batch.response_lengths[i]), "reward": float(batch.rewards[i]),
                  "loss_mask": list(map(int, batch.loss_masks[i]))}
        for field in _PER_TOKEN:
            values = getattr(batch, field)
            if values is not None and values[i] is not None:
                sample[_NAMES.get(field, field)] = _tensor(values[i])
        out.append(sample)
    return out


def payload(rollout_id: int, writer_rank: int, shards: list[list[dict[str, Any]]]) -> dict[str, Any]:
    samples = sorted((s for shard in shards for s in shard), key=lambda s: s["sample_index"])
    return {"format_version": FORMAT_VERSION, "rollout_id": rollout_id, "rank": writer_rank,
            "dp_shards": [{"data_parallel_rank": k, "samples": [s["sample_index"] for s in shard]}
                          for k, shard in enumerate(shards)],
            "samples": samples}


def save_train_data(template: str, rollout_id: int, writer_rank: int, shards: list[list[dict[str, Any]]]) -> str:
    path = template.format(rollout_id=rollout_id, rank=writer_rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(payload(rollout_id, writer_rank, shards), tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def dump(args, batch, mine: Sequence[int], rollout_id: int, *, rank: int, dp_rank: int, dp_size: int, dp_group,
         writes: bool) -> str | None:
    """Collective over the data-parallel group when `writes` (the last pipeline stage's TP/CP rank 0 of each
    DP rank: they hold the computed fields); DP rank 0 of them writes the file. Returns its path there."""
    if not args.save_debug_train_data or not writes:
        return None
    local = shard_samples(batch, mine, dp_rank)
    if dp_size == 1:
        shards = [local]
    else:
        import torch.distributed as dist

        shards = [None] * dp_size if dp_rank == 0 else None
        dist.gather_object(local, shards, dst=dist.get_global_rank(dp_group, 0), group=dp_group)
    if dp_rank != 0:
        return None
    return save_train_data(args.save_debug_train_data, rollout_id, rank, shards)
