"""Upstream slime's `slime.observability.train_data_utils`: the per-sample training fields that context
parallelism shards, gathered back to whole responses on the CPU (`restore_context_parallel_fields_to_cpu`).

Upstream's `save_debug_train_data(args, *, rollout_id, rollout_data)` is not here: this project writes
--save-debug-train-data from its own training batch (slime.backends.megatron.train_dump), in upstream's file
format, so nothing calls a function over upstream's rollout_data dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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
