"""Rollouts through upstream slime's plugin contracts, run by the rollout manager when a run names one:
`--rollout-function-path`, `--data-source-path` or `--custom-generate-function-path`, and for the flags whose
meaning is upstream's rollout loop: `--dynamic-sampling-filter-path`, `--over-sampling-batch-size`,
`--partial-rollout` (one implementation of them, slime.rollout.sglang_rollout).

The plugins see the args upstream's see: `sglang_router_ip`/`sglang_router_port` name the fleet proxy
(slime.rollout.fleet_proxy) in front of the engines, which spreads the requests over them (or passes them to
the sglang-router) and re-sends a request lost to a dead engine once the fleet has restarted it, and the data source
is upstream's `RolloutDataSourceWithBuffer` over --prompt-data (its position is the manager's data source,
saved with checkpoints) or the `--data-source-path` class built as `cls(args)`. The rollout function's
groups are flattened in order for the trainer; every sample must carry its tokens, response length,
loss mask, engine log-probs (none for SFT data) and reward (checked here, one line naming the sample).
"""

from __future__ import annotations

import copy
import time
from typing import Any
from urllib.parse import urlsplit

from slime.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.errors import RolloutError
from slime.rollout.settings import PLUGIN_FLAGS, STREAMING_FLAGS  # the flag tables (also this module's names)
from slime.utils.http_utils import init_http_client
from slime.utils.misc import load_function
from slime.utils.types import Sample

DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


def uses_plugin_rollout(args: Any) -> bool:
    return any(getattr(args, name) for name in (*PLUGIN_FLAGS, *STREAMING_FLAGS))


def plugin_args(args: Any, router_url: str, num_engines: int, engines: list | None = None) -> Any:
    """engines: an EngineClient per engine (with the run's token), for the rollout's abort of running requests."""
    out = copy.copy(args)
    out.rollout_engine_clients = list(engines or [])
    parts = urlsplit(router_url or "")  # None: no engine runs (--debug-train-only)
    out.sglang_router_ip, out.sglang_router_port = parts.hostname, parts.port
    out.rollout_num_engines = num_engines
    return out


def make_data_source(args: Any, source: Any, tokenizer: Any) -> Any:
    path = args.data_source_path
    if path:
        return load_function(path)(args)
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    return RolloutDataSourceWithBuffer(args, tokenizer, source)


def _flatten(groups: list) -> list[Sample]:
    out: list[Sample] = []
    for group in groups:
        for item in group:
            out.extend(item if isinstance(item, list) else [item])
    return out


def check_samples(samples: list[Sample], where: str) -> None:
    for s in samples:
        n = s.response_length
        problem = None
        if n < 1 or len(s.tokens) <= n:
            problem = f"response_length {n} with {len(s.tokens)} tokens (prompt + response)"
        elif s.loss_mask is not None and len(s.loss_mask) != n:
            problem = f"{len(s.loss_mask)} loss-mask entries for {n} response tokens"
        elif s.rollout_log_probs is not None and len(s.rollout_log_probs) != n:  # None: not generated (SFT data)
            problem = f"rollout_log_probs must have {n} entries (append_response_tokens fills them)"
        elif s.reward is None:
            problem = "no reward"
        if problem:
            raise RolloutError(f"{where} returned sample {s.index}: {problem}")


def run_plugin_rollout(args: Any, rollout_id: int, data_source: Any) -> tuple[list[Sample], dict[str, float]]:
    init_http_client(args)
    path = args.rollout_function_path or DEFAULT_ROLLOUT_FUNCTION
    t0 = time.perf_counter()
    out = call_rollout_fn(load_function(path), args, rollout_id, data_source, evaluation=False)
    if not isinstance(out, RolloutFnTrainOutput):
        raise RolloutError(f"--rollout-function-path {path} returned {type(out).__name__} for a training rollout")
    samples = _flatten(out.samples)
    check_samples(samples, path)
    elapsed = time.perf_counter() - t0
    tokens = sum(s.response_length for s in samples)
    metrics = {"rollout/generate_time": elapsed, "rollout/response_tokens": float(tokens),
               "rollout/truncated_ratio": sum(s.status == Sample.Status.TRUNCATED for s in samples) / max(1, len(samples)),
               "perf/engine_tokens_per_s": tokens / max(elapsed, 1e-9)}
    metrics.update({k: float(v) for k, v in (out.metrics or {}).items()})
    return samples, metrics


def uses_plugin_eval(args: Any) -> bool:
    # (the streaming flags concern training rollouts: evaluation stays the built-in one for them)
    return any(getattr(args, name) for name in ("eval_function_path", *PLUGIN_FLAGS))


def run_plugin_eval(args: Any, rollout_id: int, data_source: Any) -> dict[str, float]:
    """--eval-function-path (default: the rollout function, else upstream's generate_rollout) with
    evaluation=True; its RolloutFnEvalOutput.data ({set: {"rewards", "truncated", "samples"}}) as metrics."""
    import statistics

    from slime.rollout.base_types import RolloutFnEvalOutput

    init_http_client(args)
    path = (args.eval_function_path or args.rollout_function_path
            or DEFAULT_ROLLOUT_FUNCTION)
    t0 = time.perf_counter()
    out = call_rollout_fn(load_function(path), args, rollout_id, data_source, evaluation=True)
    if not isinstance(out, RolloutFnEvalOutput):
        raise RolloutError(f"--eval-function-path {path} returned {type(out).__name__} for an evaluation")
    metrics: dict[str, float] = {}
    for name, result in out.data.items():
        rewards = [float(r) for r in result["rewards"]]
        if not rewards:
            continue
        prefix = f"eval/{name}"
        metrics[f"{prefix}/reward_mean"] = statistics.fmean(rewards)
        metrics[f"{prefix}/reward_std"] = statistics.pstdev(rewards)
        metrics[f"{prefix}/truncated_ratio"] = sum(map(bool, result.get("truncated", []))) / len(rewards)
        metrics[f"{prefix}/samples"] = float(len(rewards))
        samples = result.get("samples") or []
        if samples:
            metrics[f"{prefix}/response_len_mean"] = statistics.fmean(s.response_length for s in samples)
    metrics.update({k: float(v) for k, v in (out.metrics or {}).items()})
    metrics["time/eval"] = time.perf_counter() - t0
    return log_eval(args, rollout_id, out.data, out.metrics, metrics)


def post_process_rewards(args: Any, samples: list[Sample], payload: dict) -> dict[str, float]:
    """--custom-reward-post-process-path: `fn(args, samples) -> (raw_rewards, rewards)`; the trainer takes
    `rewards` as they are (no group normalization of its own), as upstream's does."""
    import numpy as np

    path = args.custom_reward_post_process_path
    if not path:
        return {}
    raw, rewards = load_function(path)(args, samples)
    rewards = [float(r) for r in rewards]
    if len(rewards) != len(samples) or len(raw) != len(samples):
        raise RolloutError(f"--custom-reward-post-process-path {path} returned {len(raw)} raw and {len(rewards)} "
                           f"rewards for {len(samples)} samples")
    payload["rewards"] = np.asarray(rewards, dtype=np.float64)
    return {"rollout/raw_reward_mean": float(np.mean(raw)) if len(raw) else 0.0,
            "rollout/post_processed_reward_mean": float(np.mean(rewards)) if rewards else 0.0}


# Rollout metrics the training loops read themselves; a rollout log function that takes over logging
# (returns True) leaves these and drops the rest of the built-in rollout/perf metrics.
LOOP_METRICS = ("rollout/start_time", "rollout/end_time", "rollout/weight_version", "rollout/reward_mean",
                "rollout/response_tokens", "rollout/samples")


def train_data_payload(args: Any, samples: list[Sample]) -> dict | None:
    """--custom-convert-samples-to-train-data-path: `fn(args, samples) -> dict` as upstream's (tokens,
    response_lengths, rewards, loss_masks, optional rollout_log_probs and rollout_ids; one entry per trained
    sample), as the trainer's flat payload. Its rewards are used as they are (no reward post-process, no group
    normalization), as upstream's. None when the flag is unset."""
    import numpy as np

    path = args.custom_convert_samples_to_train_data_path
    if not path:
        return None
    data = load_function(path)(args, samples)
    where = f"--custom-convert-samples-to-train-data-path {path}"
    missing = [k for k in ("tokens", "response_lengths", "rewards", "loss_masks") if k not in (data or {})]
    if missing:
        raise RolloutError(f"{where} returned no {', '.join(missing)} (a dict of per-sample lists)")
    tokens, lengths = [list(map(int, t)) for t in data["tokens"]], [int(n) for n in data["response_lengths"]]
    masks, rewards = [list(m) for m in data["loss_masks"]], [float(r) for r in data["rewards"]]
    log_probs = data.get("rollout_log_probs")
    counts = {len(tokens), len(lengths), len(masks), len(rewards)} | ({len(log_probs)} if log_probs is not None else set())
    if len(counts) != 1:
        raise RolloutError(f"{where}: tokens, response_lengths, rewards, loss_masks (and rollout_log_probs) "
                           f"must have one entry per sample; got {len(tokens)}, {len(lengths)}, {len(rewards)}, "
                           f"{len(masks)}")
    for i, (t, n, m) in enumerate(zip(tokens, lengths, masks)):
        if not 0 < n < len(t) or len(m) != n or (log_probs is not None and len(log_probs[i]) != n):
            raise RolloutError(f"{where}: sample {i} has {len(t)} tokens, response_length {n}, {len(m)} loss-mask "
                               f"entries" + (f", {len(log_probs[i])} rollout_log_probs" if log_probs is not None else ""))
    ids = data.get("rollout_ids")  # upstream's step split needs them; without, each sample is a rollout of its own
    if ids is not None and len(ids) != len(tokens):
        raise RolloutError(f"{where}: rollout_ids has {len(ids)} entries for {len(tokens)} samples")
    total = np.array([len(t) for t in tokens], dtype=np.int64)
    return {
        "rollout_ids": None if ids is None else np.array([int(i) for i in ids], dtype=np.int64),
        "tokens": np.array([x for t in tokens for x in t], dtype=np.int64),
        "offsets": np.concatenate([[0], np.cumsum(total)]).astype(np.int64),
        "response_lengths": np.array(lengths, dtype=np.int64),
        "rewards": np.array(rewards, dtype=np.float64),
        "loss_masks": np.array([x for m in masks for x in m], dtype=np.int8),
        "rollout_log_probs": None if log_probs is None else
        np.array([float(x) for lp in log_probs for x in lp], dtype=np.float32),
    }


def log_rollout(args: Any, rollout_id: int, samples: list[Sample], metrics: dict, rollout_time: float) -> dict:
    """--custom-rollout-log-function-path: `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)
    -> bool` after each rollout; True: it logged the rollout, the built-in metrics are dropped (LOOP_METRICS stay)."""
    path = args.custom_rollout_log_function_path
    if path and load_function(path)(rollout_id, args, samples, metrics, rollout_time):
        return {k: v for k, v in metrics.items() if k in LOOP_METRICS}
    return metrics


def log_eval(args: Any, rollout_id: int, data: dict, extra_metrics: dict | None, metrics: dict) -> dict:
    """--custom-eval-rollout-log-function-path: `fn(rollout_id, args, data, extra_metrics) -> bool` after each
    evaluation ({set: {"rewards", "truncated", "samples"}}); True: the built-in eval metrics are dropped."""
    path = args.custom_eval_rollout_log_function_path
    if path and load_function(path)(rollout_id, args, data, extra_metrics):
        return {k: v for k, v in metrics.items() if not k.startswith("eval/")}
    if args.log_passrate:  # pass@k of each eval set over groups of --n-samples-per-eval-prompt
        from slime.rollout.rollout_metrics import pass_at_k

        n = args.n_samples_per_eval_prompt or 1
        for name, result in data.items():
            rewards = [float(r) for r in result.get("rewards", [])]
            if n > 1 and rewards and len(rewards) % n == 0:
                groups = [rewards[i:i + n] for i in range(0, len(rewards), n)]
                metrics.update({f"eval/{name}/{k.split('/', 1)[1]}": v for k, v in pass_at_k(groups).items()})
    return metrics
