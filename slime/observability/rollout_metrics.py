"""Upstream slime's `slime.observability.rollout_metrics`: the metrics upstream logs for a rollout's samples
(`compute_metrics_from_samples`, logged under rollout/) and its timing (`compute_perf_metrics_from_samples`,
under perf/), over this project's metric_utils, for custom rollout-log functions written against upstream.

`log_rollout_data` / `log_eval_rollout_data` are upstream's loggers, for plugin code that calls them: the custom
log-function flags first, then upstream's record (extra metrics, rollout/ or eval/ metrics, perf/, the step) sent
to this process's trackers (`send_to_trackers`). This project's own runs do not call them: its rollout manager
returns a rollout's metrics to the driver, which records them in metrics.jsonl and the trackers
(slime.rollout.plugin_rollout.log_rollout / log_eval honor the same flags)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

from slime.observability.metric_utils import (compute_pass_rate, compute_rollout_step, compute_statistics,
                                              dict_add_prefix, has_repetition)
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# metric -> the key of an SGLang request's profile in a "sglang_generate" span_end event of `sample.trace`
# (upstream's trace_utils writes them; request timing, then PD-disaggregation prefill and decode timing)
SGLANG_PERF_FIELDS = (
    ("request/e2e_latency", "e2e_latency"), ("request/queue_time", "queue_time"),
    ("decode/throughput", "decode_throughput"),
    ("prefill/bootstrap_queue_duration", "pd_prefill_bootstrap_queue_duration"),
    ("prefill/bootstrap_duration", "pd_prefill_bootstrap_duration"),
    ("prefill/alloc_wait_duration", "pd_prefill_alloc_wait_duration"),
    ("prefill/forward_duration", "pd_prefill_forward_duration"),
    ("prefill/transfer_queue_duration", "pd_prefill_transfer_queue_duration"),
    ("prefill/transfer_speed_gb_s", "pd_transfer_speed_gb_s"), ("prefill/transfer_total_mb", "pd_transfer_total_mb"),
    ("prefill/retry_count", "pd_prefill_retry_count"),
    ("decode/prealloc_duration", "pd_decode_prealloc_duration"),
    ("decode/bootstrap_duration", "pd_decode_bootstrap_duration"),
    ("decode/alloc_wait_duration", "pd_decode_alloc_wait_duration"),
    ("decode/transfer_duration", "pd_decode_transfer_duration"),
    ("decode/forward_duration", "pd_decode_forward_duration"),
)


def _group(items, key) -> dict:
    groups = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return dict(groups)


def _zero_std_counts(args: Any, samples: list[Sample]) -> dict[str, int]:
    """zero_std/count_<reward>: how many prompt groups got one reward on every sample (no learning signal)."""
    if args.advantage_estimator == "ppo":  # one response per prompt: nothing to count
        return {}
    flat = []
    for group in _group(samples, lambda s: s.group_index).values():
        rewards = [s.get_reward_value(args) for s in group]
        if all(r == rewards[0] for r in rewards):
            flat.append(str(round(rewards[0], 1)))
    return {f"zero_std/count_{reward}": len(items) for reward, items in _group(flat, lambda r: r).items()}


def _top_p_kept_vocab(samples: list[Sample]) -> dict[str, float]:
    """Mean number of vocabulary entries the top-p filter kept per trained response token."""
    kept = tokens = 0
    for s in samples:
        offsets = s.rollout_top_p_token_offsets
        if offsets is None or s.response_length == 0:
            continue
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        if offsets.numel() == 0:
            continue
        assert offsets.numel() == s.response_length + 1, \
            f"top-p token offsets length {offsets.numel()} != response length + 1 {s.response_length + 1}"
        if s.remove_sample:
            continue
        if s.loss_mask is None:
            kept, tokens = kept + int(offsets[-1] - offsets[0]), tokens + s.response_length
            continue
        mask = torch.as_tensor(s.loss_mask, dtype=torch.bool)
        assert mask.numel() == s.response_length, \
            f"loss mask length {mask.numel()} != response length {s.response_length}"
        kept, tokens = kept + int(torch.diff(offsets)[mask].sum()), tokens + int(mask.sum())
    return {"top_p_kept_vocab_per_token": kept / tokens} if tokens else {}


def _engine_metrics(args: Any, samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    out = {}
    # SGLang server flags reach the engine without each being a flag here; upstream reads this one as optional
    if vars(args).get("sglang_speculative_algorithm") is not None:
        out["spec_accept_rate"] = sum(s.spec_info.spec_accept_rate for s in samples) / n
        out["spec_accept_length"] = sum(s.spec_info.spec_accept_length for s in samples) / n
    cached = sum(s.prefix_cache_info.cached_tokens for s in samples)
    prompt = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    out["prefix_cache_hit_rate"] = cached / prompt if prompt > 0 else 0.0
    out["avg_cached_tokens_per_sample"] = cached / n
    return out


def compute_metrics_from_samples(args: Any, samples: list[Sample]) -> dict[str, float]:
    """Response lengths (effective: trained tokens), zero-std groups, speculative decoding and prefix cache
    rates, reward categories (--log-reward-category), top-p kept vocabulary, repetition and truncation shares."""
    out = dict_add_prefix(compute_statistics([s.effective_response_length for s in samples]), "response_len/")
    out |= _zero_std_counts(args, samples)
    out |= _engine_metrics(args, samples)
    if args.log_reward_category is not None:
        by_category = _group(samples, lambda s: s.reward[args.log_reward_category])
        out |= {f"error_cat/{cat}": len(group) / len(samples) for cat, group in by_category.items()}
    out |= _top_p_kept_vocab(samples)
    out["repetition_frac"] = sum(int(has_repetition(s.response)) for s in samples) / len(samples)
    out["truncated_ratio"] = sum(int(s.status == Sample.Status.TRUNCATED) for s in samples) / len(samples)
    return out


def _sglang_request_attrs(samples: list[Sample]):
    for sample in samples:
        trace = getattr(sample, "trace", None)  # set by upstream-style traced generate functions only
        if not isinstance(trace, dict):
            continue
        for event in trace.get("events") or []:
            if event.get("type") == "span_end" and event.get("name") == "sglang_generate" \
                    and isinstance(event.get("attrs"), dict):
                yield event["attrs"]


def _sglang_request_perf(samples: list[Sample]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for attrs in _sglang_request_attrs(samples):
        for metric, source in SGLANG_PERF_FIELDS:
            value = attrs.get(source)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
                    and abs(value) != float("inf"):
                values.setdefault(metric, []).append(float(value))
    out: dict[str, float] = {}
    for metric, found in values.items():
        out |= dict_add_prefix(compute_statistics(found), f"{metric}/")
    return out


def _token_perf(args: Any, out: dict, lengths: list[int], non_generation: list[float], rollout_time: float,
                key: str) -> None:
    longest = max(lengths)
    if args.rollout_num_gpus:
        out[f"{key}tokens_per_gpu_per_sec"] = sum(lengths) / rollout_time / args.rollout_num_gpus
    out[f"longest_{key}sample_tokens_per_sec"] = longest / rollout_time
    if max(non_generation) == 0:
        return
    of_longest = [t for t, length in zip(non_generation, lengths, strict=True) if length == longest]
    mean = sum(of_longest) / len(of_longest)
    out[f"longest_{key}sample_non_generation_time"] = mean
    out[f"longest_{key}sample_tokens_per_sec_without_non_generation"] = longest / (rollout_time - mean)


def compute_perf_metrics_from_samples(args: Any, samples: list[Sample], rollout_time: float) -> dict[str, float]:
    """Rollout time, time outside generation (tools), tokens per second per GPU and of the longest sample (all
    response tokens, then only the trained ones), and SGLang's per-request timing where samples carry a trace."""
    non_generation = [s.non_generation_time for s in samples]
    out: dict[str, float] = {"rollout_time": rollout_time}
    if max(non_generation) > 0:
        out |= dict_add_prefix(compute_statistics(non_generation), "non_generation_time/")
    _token_perf(args, out, [s.response_length for s in samples], non_generation, rollout_time, "")
    _token_perf(args, out, [s.effective_response_length for s in samples], non_generation, rollout_time, "effective_")
    out |= _sglang_request_perf(samples)
    return out


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """Upstream's rollout logger: `--custom-rollout-log-function-path` first (True: it logged the rollout); nothing
    for a rollout replayed from `--load-debug-rollout-data`; else the extra metrics, rollout/ and perf/ metrics of
    the samples and `rollout/step`, sent to the trackers."""
    if args.custom_rollout_log_function_path is not None and load_function(args.custom_rollout_log_function_path)(
            rollout_id, args, samples, rollout_extra_metrics, rollout_time):
        return
    if args.load_debug_rollout_data:
        return
    record = {**(rollout_extra_metrics or {})}
    record |= dict_add_prefix(compute_metrics_from_samples(args, samples), "rollout/")
    record |= dict_add_prefix(compute_perf_metrics_from_samples(args, samples, rollout_time), "perf/")
    logger.info(f"perf {rollout_id}: {record}")
    record["rollout/step"] = compute_rollout_step(args, rollout_id)
    send_to_trackers(args, record, "rollout/step")


def log_eval_rollout_data(rollout_id, args, data, extra_metrics: dict[str, Any] | None = None):
    """Upstream's evaluation logger: `--custom-eval-rollout-log-function-path` first (True: it logged; None is
    returned); else per eval set its mean reward (`eval/<set>`), the samples' metrics, the truncated ratio and,
    with `--log-passrate`, pass@k over groups of `--n-samples-per-eval-prompt`, plus `eval/step`, added to
    `extra_metrics` itself when given (as upstream does), sent to the trackers and returned."""
    if args.custom_eval_rollout_log_function_path is not None and load_function(
            args.custom_eval_rollout_log_function_path)(rollout_id, args, data, extra_metrics):
        return None
    record = extra_metrics or {}
    for name, result in data.items():
        rewards = result["rewards"]
        record[f"eval/{name}"] = sum(rewards) / len(rewards)
        if result.get("samples") is not None:
            record |= dict_add_prefix(compute_metrics_from_samples(args, result["samples"]), f"eval/{name}/")
        if "truncated" in result:
            record[f"eval/{name}-truncated_ratio"] = sum(result["truncated"]) / len(result["truncated"])
        if args.log_passrate:
            record |= dict_add_prefix(compute_pass_rate(flat_rewards=rewards,
                                                        group_size=args.n_samples_per_eval_prompt), f"eval/{name}-")
    logger.info(f"eval {rollout_id}: {record}")
    record["eval/step"] = compute_rollout_step(args, rollout_id)
    send_to_trackers(args, record, "eval/step")
    return record


_TENSORBOARD_WRITERS: dict[str, Any] = {}


def send_to_trackers(args, record: dict[str, Any], step_key: str) -> None:
    """`record` to W&B when a run is active in this process (`--use-wandb`) and to TensorBoard (`--use-tensorboard`,
    a writer per directory in this process, in the run's TensorBoard directory) at `record[step_key]`."""
    import importlib.util
    import sys

    if args.use_wandb and "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].log(record)
    if args.use_tensorboard and importlib.util.find_spec("tensorboard") is not None:
        from slime.utils.tracking import tensorboard_dir

        path = tensorboard_dir(args)
        if path not in _TENSORBOARD_WRITERS:
            from torch.utils.tensorboard import SummaryWriter

            _TENSORBOARD_WRITERS[path] = SummaryWriter(log_dir=path)
        writer = _TENSORBOARD_WRITERS[path]
        for key, value in record.items():
            if key != step_key and isinstance(value, (int, float)):
                writer.add_scalar(key, value, record[step_key])
        writer.flush()
