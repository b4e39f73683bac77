"""One rollout: `--rollout-batch-size` prompts x `--n-samples-per-prompt` responses, generated over
the engine fleet with at most `--max-concurrency` requests in flight, each scored as it completes.

Every sample is tracked by its index from creation to result. A request lost to an engine failure
(connection refused/reset) is reported to the fleet (which restarts the engine) and re-issued; one
the engine aborted (pause for a weight update) is re-issued after the fleet resumes. Sampling seeds
derive from `--rollout-seed` and the sample index, so a re-issued request asks for the same draw.
The rollout either returns every sample exactly once, completed and rewarded, or raises
`RolloutError` naming the cause; it never drops or duplicates one silently.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Protocol

from slime.rollout.data_source import PromptItem
from slime.rollout.rewards import RewardFn, compute_reward
from slime.rollout.sample import Sample, SampleStatus
from slime.utils.http_client import EngineClient, EngineError, EngineUnreachable

MAX_FAILED_ATTEMPTS = 8  # per sample: engine failures it may survive
MAX_ABORTS = 50  # per sample: pauses it may be caught in


class RolloutError(RuntimeError):
    """The rollout cannot complete. One line: which sample/engine and why (plus the engine's log tail)."""


class EngineFleet(Protocol):
    def acquire(self) -> int: ...
    def release(self, idx: int, served: bool) -> None: ...
    def client(self, idx: int) -> EngineClient: ...
    def generation(self, idx: int) -> int: ...
    def report_failure(self, idx: int, generation: int, error: BaseException) -> None: ...
    def wait_unpaused(self) -> None: ...
    def note_version(self, idx: int, version: str | None) -> None: ...


def sampling_params(args: Any, seed: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": int(args.rollout_max_response_len),
        "temperature": float(args.rollout_temperature),
        "top_p": float(args.rollout_top_p),
        "top_k": int(getattr(args, "rollout_top_k", -1)),
        "sampling_seed": seed,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    stop_ids = getattr(args, "rollout_stop_token_ids", None)
    if stop_ids:
        params["stop_token_ids"] = list(stop_ids)
    return params


def sample_seed(args: Any, index: int) -> int:
    return (int(getattr(args, "rollout_seed", 0)) * 1_000_003 + index) % (1 << 62)


def make_samples(items: list[PromptItem], n_per_prompt: int, indices: range) -> list[Sample]:
    it = iter(indices)
    return [Sample(group_index=p.group_index, index=next(it), prompt=p.prompt, prompt_length=len(p.prompt_ids),
                   tokens=list(p.prompt_ids), label=p.label, metadata=dict(p.metadata))
            for p in items for _ in range(n_per_prompt)]


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.reissued = 0
        self.aborted = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class EngineTimes:
    """Engine-side time of one rollout: differences of each engine's cumulative stats (the embedded engine
    reports them in /health), read before its first request of the rollout and after the last. Engines
    without stats (SGLang) or restarted during the rollout (counters start again) are left out."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.lock = threading.Lock()
        self.before: dict[int, dict[str, float] | None] = {}

    def first_use(self, idx: int) -> None:
        if idx in self.before:
            return
        with self.lock:  # the snapshot precedes every request of this rollout to the engine
            if idx not in self.before:
                self.before[idx] = _engine_stats(self.fleet.client(idx))

    def metrics(self) -> dict[str, float]:
        deltas = []
        for idx, before in self.before.items():
            after = _engine_stats(self.fleet.client(idx))
            if before is None or after is None or after.get("wave_seconds", 0.0) < before.get("wave_seconds", 0.0):
                continue
            deltas.append({k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in after})
        if not deltas:
            return {}
        # Engines generate in parallel: the busiest one bounds the rollout.
        return {"rollout/engine_generate_time": max(d.get("wave_seconds", 0.0) for d in deltas),
                "rollout/engine_forward_time": max(d.get("forward_seconds", 0.0) for d in deltas),
                "rollout/engine_waves": sum(d.get("waves", 0.0) for d in deltas),
                "rollout/engine_joins": sum(d.get("joins", 0.0) for d in deltas)}


def _engine_stats(client: Any) -> dict[str, float] | None:
    try:
        health = client.get("/health", timeout=10.0)
    except Exception:  # no stats (an engine without them, a stand-in client, an engine that is down)
        return None
    stats = health.get("stats") if isinstance(health, dict) else None
    return stats if isinstance(stats, dict) and "wave_seconds" in stats else None


def _finish_sample(sample: Sample, out: dict[str, Any], idx: int, tokenizer: Any) -> None:
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = meta.get("output_token_logprobs")
    if not ids:
        raise RolloutError(f"sample {sample.index}: engine {idx} returned an empty response; "
                           "--rollout-max-response-len must be >= 1")
    if logprobs is None or len(logprobs) != len(ids) or [int(x[1]) for x in logprobs] != ids:
        raise RolloutError(f"sample {sample.index}: engine {idx} returned logprobs that do not match its tokens")
    sample.tokens = sample.tokens[: sample.prompt_length] + ids
    sample.response_length = len(ids)
    sample.loss_mask = [1] * len(ids)
    sample.rollout_log_probs = [float(x[0]) for x in logprobs]
    sample.response = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else out.get("text", "")
    sample.status = SampleStatus.COMPLETED if meta["finish_reason"]["type"] == "stop" else SampleStatus.TRUNCATED
    sample.weight_version = meta.get("weight_version")
    sample.engine_index = idx


def run_samples(args: Any, fleet: EngineFleet, samples: list[Sample], tokenizer: Any, reward_fn: RewardFn | None,
                progress: _Counters | None = None, engine_times: EngineTimes | None = None) -> _Counters:
    """Generate (and score) every sample in place. Raises RolloutError on the first unrecoverable failure."""
    counters = progress or _Counters()
    stop = threading.Event()
    timeout = float(getattr(args, "rollout_request_timeout", 3600.0) or 3600.0)

    def one(sample: Sample) -> None:
        failures, aborts = 0, 0
        last_error: BaseException | None = None
        while True:
            if stop.is_set():
                return
            if failures >= MAX_FAILED_ATTEMPTS:
                raise RolloutError(f"sample {sample.index} failed on {failures} engine attempts; last error: {last_error}")
            if aborts >= MAX_ABORTS:
                raise RolloutError(f"sample {sample.index} was aborted {aborts} times (engines kept pausing)")
            fleet.wait_unpaused()
            idx = fleet.acquire()
            if engine_times is not None:
                engine_times.first_use(idx)
            gen = fleet.generation(idx)
            sample.attempts += 1
            try:
                out = fleet.client(idx).generate(sample.prompt_tokens, sampling_params(args, sample_seed(args, sample.index)),
                                                 return_logprob=True, timeout=timeout)
            except EngineUnreachable as e:
                fleet.release(idx, served=False)
                failures += 1
                last_error = e
                counters.add(reissued=1)
                fleet.report_failure(idx, gen, e)  # restarts the engine, or raises RolloutError
                continue
            except EngineError as e:
                fleet.release(idx, served=False)
                raise RolloutError(f"engine {idx} rejected sample {sample.index}: {e.message}") from e
            fleet.release(idx, served=True)
            finish = out["meta_info"]["finish_reason"]
            if finish["type"] == "abort":
                if str(finish.get("message", "")).startswith("engine error"):
                    # A failing forward pass fails again on retry: report it instead of looping.
                    raise RolloutError(f"engine {idx} failed on sample {sample.index}: {finish['message']}")
                aborts += 1
                counters.add(aborted=1)
                continue
            fleet.note_version(idx, out["meta_info"].get("weight_version"))
            _finish_sample(sample, out, idx, tokenizer)
            if reward_fn is not None:
                sample.reward = compute_reward(reward_fn, args, sample)
            counters.add(done=1)
            return

    def guarded(sample: Sample) -> None:
        try:
            one(sample)
        except BaseException:
            stop.set()  # the first failure stops new requests at once
            raise

    workers = max(1, min(int(getattr(args, "max_concurrency", 64)), len(samples)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") as pool:
        futures = [pool.submit(guarded, s) for s in samples]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in finished if f.exception() is not None]
        if errors:
            stop.set()  # in-flight requests finish; nothing new is sent
            for f in futures:
                f.cancel()
            raise errors[0]
    missing = [s.index for s in samples if s.status == SampleStatus.PENDING]
    if missing:
        raise RolloutError(f"{len(missing)} samples never completed (e.g. {missing[:5]}); this is a bug")
    return counters


def rollout_metrics(samples: list[Sample], counters: _Counters, elapsed: float) -> dict[str, float]:
    n = max(1, len(samples))
    tokens = sum(s.response_length for s in samples)
    return {
        "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / n,
        "rollout/reissued_requests": float(counters.reissued),
        "rollout/aborted_requests": float(counters.aborted),
        "rollout/response_tokens": float(tokens),
        "rollout/generate_time": elapsed,
        "perf/engine_tokens_per_s": tokens / max(elapsed, 1e-9),
    }


def check_exactly_once(samples: list[Sample], expected: range) -> None:
    got = sorted(s.index for s in samples)
    if got != list(expected):
        raise RolloutError(f"rollout returned sample indices {got[:8]}... but expected {expected}; this is a bug")


def generate_rollout(args: Any, fleet: EngineFleet, data_source: Any, tokenizer: Any, reward_fn: RewardFn | None,
                     progress: _Counters | None = None) -> tuple[list[Sample], dict[str, float]]:
    if not getattr(args, "rollout_batch_size", None):
        raise RolloutError("--rollout-batch-size is required (prompts per rollout)")
    n = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    items = data_source.next_batch(int(args.rollout_batch_size))
    indices = data_source.take_sample_indices(len(items) * n)
    samples = make_samples(items, n, indices)
    t0 = time.perf_counter()
    engine_times = EngineTimes(fleet)
    counters = run_samples(args, fleet, samples, tokenizer, reward_fn, progress, engine_times)
    check_exactly_once(samples, indices)
    metrics = rollout_metrics(samples, counters, time.perf_counter() - t0)
    metrics.update(engine_times.metrics())
    return samples, metrics
