"""Upstream slime's `slime.observability.metric_utils`: pass@k, summary statistics, compression-based
repetition detection and the logging step, over this project's metric code (slime.rollout.rollout_metrics)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import statistics
import zlib
from typing import Any

from slime.rollout.rollout_metrics import pass_at_k

_COMPRESSORS = {
    "zlib": lambda raw, level: zlib.compress(raw, level),
    "gzip": lambda raw, level: gzip.compress(raw, compresslevel=level),
    "bz2": lambda raw, level: bz2.compress(raw, compresslevel=level),
    "lzma": lambda raw, level: lzma.compress(raw, preset=level),
}
REPETITION_WINDOW = 10000  # characters: the tail whose compressibility flags a looping response (upstream's)
REPETITION_RATIO = 10.0


def dict_add_prefix(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in d.items()}


def compute_pass_rate(flat_rewards: list[float], group_size: int, num_groups: int | None = None) -> dict[str, float]:
    """{"pass@k": mean unbiased estimate} for k = 1, 2, 4, ... <= group_size (reward exactly 1 passes); {} for
    groups of one."""
    if group_size == 1:
        return {}
    num_groups = len(flat_rewards) // group_size if num_groups is None else num_groups
    if len(flat_rewards) != num_groups * group_size:
        raise ValueError(f"{len(flat_rewards)} rewards are not {num_groups} groups of {group_size}")
    groups = [list(flat_rewards[i * group_size:(i + 1) * group_size]) for i in range(num_groups)]
    return {name.removeprefix("passrate/"): value for name, value in pass_at_k(groups).items()}


def compute_statistics(values: list[float]) -> dict[str, float]:
    values = [float(v) for v in values]
    return {"mean": statistics.fmean(values), "median": float(statistics.median(values)), "max": max(values),
            "min": min(values)}


def compression_ratio(data: str | bytes, *, encoding: str = "utf-8", algorithm: str = "zlib",
                      level: int = 9) -> tuple[float, float]:
    """(original / compressed size, percent saved); (inf, 0.0) for empty data."""
    raw = data.encode(encoding) if isinstance(data, str) else data
    if not raw:
        return float("inf"), 0.0
    if algorithm not in _COMPRESSORS:
        raise ValueError(f"Unsupported algorithm: {algorithm}")
    size = len(_COMPRESSORS[algorithm](raw, level))
    if size == 0:
        return float("inf"), 100.0
    return len(raw) / size, 100.0 * (1.0 - size / len(raw))


def has_repetition(text: str) -> bool:
    """A response longer than the window whose last window compresses more than tenfold."""
    return len(text) > REPETITION_WINDOW and compression_ratio(text[-REPETITION_WINDOW:])[0] > REPETITION_RATIO


def compute_rollout_step(args, rollout_id: int) -> int:
    """The step a rollout's metrics are logged at: the rollout, or with --wandb-always-use-train-step the
    optimizer steps taken before it."""
    if args.wandb_always_use_train_step:
        return rollout_id * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    return rollout_id
