"""Upstream slime's `slime.observability.train_data_utils`: the per-sample training fields that context
parallelism shards, gathered back to whole responses on the CPU (`restore_context_parallel_fields_to_cpu`).

`save_debug_train_data(args, *, rollout_id, rollout_data)` is upstream's writer over upstream's rollout_data dict
(its per-sample lists, its layout fields), for plugin code that calls it, with upstream's file layout
(`train_dump_payload`). This project's own runs write --save-debug-train-data from their training batch
(slime.backends.megatron.train_dump) through the same `train_dump_payload`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Per-token fields each CP rank holds only its slice of (upstream's list).
CONTEXT_PARALLEL_FIELDS = ("rollout_log_probs", "teacher_log_probs", "log_probs", "ref_log_probs", "values",
                           "advantages", "returns", "kl", "entropy", "opd_reverse_kl")


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_to_cpu(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _checked_field(rollout_data: dict[str, Any], key: str, num_samples: int) -> list | tuple | None:
    values = rollout_data.get(key)
    if values is None:
        return None
    if not isinstance(values, (list, tuple)) or len(values) != num_samples:
        count = len(values) if isinstance(values, (list, tuple)) else "not a list or tuple"
        raise ValueError(f"CP-sharded field {key!r} must contain one tensor per sample, got {count}; "
                         f"expected {num_samples}.")
    return values


@torch.no_grad()
def restore_context_parallel_fields_to_cpu(rollout_data: dict[str, Any],
                                           gather_tensor: Callable[[torch.Tensor, int, int], torch.Tensor], *,
                                           keep_restored: bool) -> dict[str, Any] | None:
    """Every CP-sharded field's tensors through `gather_tensor(value, total_length, response_length)` (a
    collective: every CP rank calls it for the same tensors in the same order); with `keep_restored`, a copy of
    rollout_data on the CPU with the whole responses, else None (a rank that only takes part in the gathers).
    ValueError / TypeError when the fields do not hold one tensor per sample or a gather returns another length."""
    total_lengths, response_lengths = rollout_data["total_lengths"], rollout_data["response_lengths"]
    num_samples = len(response_lengths)
    if len(total_lengths) != num_samples:
        raise ValueError("total_lengths and response_lengths must contain the same number of samples, "
                         f"got {len(total_lengths)} and {num_samples}.")
    restored = ({key: _to_cpu(value) for key, value in rollout_data.items() if key not in CONTEXT_PARALLEL_FIELDS}
                if keep_restored else None)
    for key in CONTEXT_PARALLEL_FIELDS:
        values = _checked_field(rollout_data, key, num_samples)
        if values is None:
            continue
        whole = []
        for index, (value, total_length, response_length) in enumerate(zip(values, total_lengths, response_lengths)):
            if not torch.is_tensor(value):
                raise TypeError(f"CP-sharded field {key!r} sample {index} must be a tensor, "
                                f"got {type(value).__name__}.")
            gathered = gather_tensor(value, int(total_length), int(response_length)).detach()
            if gathered.size(0) != response_length:
                raise ValueError(f"Restored field {key!r} sample {index} has length {gathered.size(0)}, "
                                 f"expected {response_length}.")
            if keep_restored:
                whole.append(gathered.cpu())
            del gathered  # one whole response on the device at a time: the next gather allocates its own
        if keep_restored:
            restored[key] = whole
    return restored


# a DP rank's batch-scheduling fields (kept with its shard), and fields equal on every rank (kept once, at the top)
LAYOUT_FIELDS = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
WHOLE_BATCH_FIELDS = ("raw_reward",)
_ID_COLUMNS = {"sample_indices": "sample_index", "partition": "rollout_position"}


def _one_per_sample(value: Any, num_samples: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.size(0) == num_samples
    return isinstance(value, (list, tuple)) and len(value) == num_samples


def train_dump_payload(dp_shards: list[dict[str, Any]], *, rollout_id: int, writer_rank: int) -> dict[str, Any]:
    """Upstream's train-dump file from the DP shards (`{"rank", "data_parallel_rank", "rollout_data"}`): one dict per
    trained sample (its per-sample fields, `data_parallel_rank`, `sample_index` / `rollout_position` from
    `sample_indices` / `partition`) in rollout order (by position, else by index, else as gathered), each shard's
    ids and other fields under `dp_shards`, whole-batch fields once at the top."""
    samples, layout, whole_batch = [], [], {}
    for shard in dp_shards:
        data, dp_rank = shard["rollout_data"], shard["data_parallel_rank"]
        count = len(data["response_lengths"])
        entry = {"rank": shard["rank"], "data_parallel_rank": dp_rank}
        entry.update({col: None if data.get(col) is None else list(data[col]) for col in _ID_COLUMNS})
        columns = {}
        for key, value in data.items():
            if key in _ID_COLUMNS:
                continue
            if key in WHOLE_BATCH_FIELDS:
                whole_batch.setdefault(key, value)
            elif key in LAYOUT_FIELDS or not _one_per_sample(value, count):
                entry[key] = value
            else:
                columns[key] = value
        for i in range(count):
            sample = {"data_parallel_rank": dp_rank}
            sample.update({name: data[col][i] for col, name in _ID_COLUMNS.items() if data.get(col) is not None})
            sample.update({key: column[i] for key, column in columns.items()})
            samples.append(sample)
        layout.append(entry)
    order = next((key for key in ("rollout_position", "sample_index")
                  if samples and all(s.get(key) is not None for s in samples)), None)
    if order is None:
        logger.warning("Cannot restore global sample order for the train debug dump: samples carry neither "
                       "partition nor sample_index. Saving samples in DP-gather order instead.")
    else:
        samples.sort(key=lambda s: s[order])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": writer_rank, "samples": samples,
            "dp_shards": layout, **whole_batch}


def save_debug_train_data(args, *, rollout_id, rollout_data):
    """Upstream's --save-debug-train-data writer: on the last pipeline stage's TP rank 0, the CP-sharded fields
    gathered to whole responses (all CP ranks take part), the DP shards gathered to DP rank 0 (gloo), which writes
    `train_dump_payload` to the path template (`{rollout_id}`, `{rank}`). Nothing without the flag."""
    if args.save_debug_train_data is None:
        return
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

    if not mpu.is_pipeline_last_stage(ignore_virtual=True) or mpu.get_tensor_model_parallel_rank() != 0:
        return
    cp_rank = mpu.get_context_parallel_rank()
    rollout_data = restore_context_parallel_fields_to_cpu(rollout_data, all_gather_with_cp, keep_restored=cp_rank == 0)
    if cp_rank != 0:
        return
    rank = torch.distributed.get_rank()
    local = {"rank": rank, "data_parallel_rank": mpu.get_data_parallel_rank(with_context_parallel=False),
             "rollout_data": rollout_data}
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    writer = mpu.get_data_parallel_src_rank(with_context_parallel=False)
    shards = [local]
    if dp_size > 1:
        shards = [None] * dp_size if rank == writer else None
        torch.distributed.gather_object(local, shards, dst=writer,
                                        group=mpu.get_data_parallel_group_gloo(with_context_parallel=False))
    if rank != writer:
        return
    path = args.save_debug_train_data.format(rollout_id=rollout_id, rank=rank)
    logger.info(f"Save debug train data from {dp_size} DP shard(s) to {path}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(train_dump_payload(shards, rollout_id=rollout_id, writer_rank=rank), path)
