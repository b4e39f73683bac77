"""One rollout: `--rollout-batch-size` prompts x `--n-samples-per-prompt` responses, generated over
the engine fleet with at most `--max-concurrency` samples in flight, each scored as it completes.
Samples travel in batched /generate requests, one share per engine (see `samples_per_request`).

Every sample is tracked by its index from creation to result. A request lost to an engine failure
(connection refused/reset) is reported to the fleet (which restarts the engine) and re-issued; one
the engine aborted (pause for a weight update) is re-issued after the fleet resumes. Sampling seeds
derive from `--rollout-seed` and the sample index, so a re-issued request asks for the same draw.
The rollout either returns every sample exactly once, completed and rewarded, or raises
`RolloutError` naming the cause; it never drops or duplicates one silently.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from slime.rollout.data_source import make_samples
from slime.rollout.engine_times import EngineTimes
from slime.rollout.errors import RolloutError
from slime.rollout.filter_hub.base_types import MetricGatherer
from slime.rollout.rewards import RewardFn, compute_group_rewards, compute_reward, compute_rewards
from slime.rollout.sample import Sample, SampleStatus
from slime.rollout.sample_hooks import apply_in_place
# request_concurrency: --sglang-server-concurrency x engines, within --max-concurrency
from slime.rollout.settings import STREAMING_FLAGS, request_concurrency
from slime.rollout.streaming import sort_groups, stream_groups
from slime.utils.async_utils import run
from slime.utils.http_client import EngineClient, EngineError, EngineUnreachable

MAX_FAILED_ATTEMPTS = 8  # per sample: engine failures it may survive
MAX_ABORTS = 50  # per sample: pauses it may be caught in


class EngineFleet:
    """The engines as generate_rollout sees them (slime.ray.engine_fleet.RolloutEngines is one; tests fake one).
    Every method a caller uses is declared here, the optional ones with their default, so no caller probes
    with getattr."""

    def acquire(self) -> int:
        """An engine index to send the next request to (blocks while all are busy)."""
        raise NotImplementedError

    def release(self, idx: int, served: bool) -> None:
        raise NotImplementedError

    def client(self, idx: int) -> EngineClient:
        raise NotImplementedError

    def generation(self, idx: int) -> int:
        """A token that changes when engine `idx` is restarted."""
        raise NotImplementedError

    def report_failure(self, idx: int, generation: int, error: BaseException) -> None:
        raise NotImplementedError

    def wait_unpaused(self) -> None:
        return None

    def note_version(self, idx: int, version: str | None) -> None:
        return None

    def num_engines(self) -> int | None:
        """How many engines serve (each then gets its share in batched requests); None: not known, a
        request per sample."""
        return None

    def batched_requests(self) -> bool:
        """Whether one /generate request may carry several samples."""
        return True

    def behind_router(self) -> bool:
        """Whether generation goes through sglang-router (its 5xx replies then mean an engine died)."""
        return False

    def generation_client(self, idx: int) -> EngineClient:
        """Where generation requests for engine `idx` go (the router, when one is in front)."""
        return self.client(idx)


def sampling_params(args: Any, seed: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": int(args.rollout_max_response_len),
        "temperature": float(args.rollout_temperature),
        "top_p": float(args.rollout_top_p),
        "top_k": int(args.rollout_top_k),
        "sampling_seed": seed,
        "skip_special_tokens": bool(args.rollout_skip_special_tokens),
        "no_stop_trim": True,
    }
    stop_ids = args.rollout_stop_token_ids
    if stop_ids:
        params["stop_token_ids"] = list(stop_ids)
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)  # stop strings (upstream's --rollout-stop)
    return params


def sample_seed(args: Any, index: int) -> int:
    return (int(args.rollout_seed) * 1_000_003 + index) % (1 << 62)


class RolloutCounters:
    """One rollout's progress, shared by its sending threads and the fleet proxy: samples done, samples re-issued
    after a lost request (rollout/reissued_requests), samples aborted by a pause (rollout/aborted_requests)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.reissued = 0
        self.aborted = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def _finish_sample(sample: Sample, out: dict[str, Any], idx: int, tokenizer: Any,
                   skip_special_tokens: bool = False, routes: Any = None) -> None:
    """routes: the args (num_layers, moe_router_topk) to read meta_info's routed experts and indexer top-k
    with, or None."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = meta.get("output_token_logprobs")
    if not ids:
        raise RolloutError(f"sample {sample.index}: engine {idx} returned an empty response; "
                           "--rollout-max-response-len must be >= 1")
    if logprobs is None or len(logprobs) != len(ids) or [int(x[1]) for x in logprobs] != ids:
        raise RolloutError(f"sample {sample.index}: engine {idx} returned logprobs that do not match its tokens")
    sample.tokens = sample.prompt_tokens + ids
    sample.response_length = len(ids)
    sample.loss_mask = [1] * len(ids)
    sample.rollout_log_probs = [float(x[0]) for x in logprobs]
    # the response text keeps special tokens unless --rollout-skip-special-tokens, as upstream's engine text does
    sample.response = (tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
                       if tokenizer is not None else out.get("text", ""))
    sample.status = SampleStatus.COMPLETED if meta["finish_reason"]["type"] == "stop" else SampleStatus.TRUNCATED
    sample.weight_version = meta.get("weight_version")
    sample.engine_index = idx
    if routes is not None:  # --use-rollout-routing-replay: the engine's experts per fed token
        sample.rollout_routed_experts = None
        sample._apply_routed_experts(routes, meta)
        sample.rollout_indexer_topk = None  # --use-rollout-indexer-replay: the DSA layers' keys per fed token
        sample._apply_indexer_topk(routes, meta)


def samples_per_request(args: Any, fleet: Any, num_samples: int) -> int:
    """Samples per /generate request: the rollout split evenly over the engines (one batched request each,
    so an engine gets its whole share at once: one wave, no per-request HTTP round trips), at most
    --max-concurrency over all engines. 1 (a request per sample) for a fleet that does not say how many engines it has."""
    count = fleet.num_engines()
    if count is None or not fleet.batched_requests():
        return 1
    engines = max(1, int(count))
    # every engine gets a request in flight (the router spreads them) within --max-concurrency samples
    return max(1, min(request_concurrency(args, engines) // engines, -(-num_samples // engines)))


def load_generate_function(args: Any):
    """--custom-generate-function-path: fn(args, sample, sampling_params) -> Sample (may be async), upstream's
    signature. It is called once per sample with `args.sglang_router_ip`/`args.sglang_router_port` naming
    the engine chosen for it and `args.engine_client`, an authenticated EngineClient for that engine; it
    returns the sample with tokens (prompt + response), response_length, loss_mask and rollout_log_probs set."""
    if not args.custom_generate_function_path:
        return None
    from slime.rollout.rewards import load_custom

    return load_custom(args.custom_generate_function_path, "--custom-generate-function-path")


def _custom_generate(fn: Any, args: Any, client: EngineClient, sample: Sample, params: dict[str, Any]) -> None:
    import asyncio
    import copy
    import inspect

    call_args = copy.copy(args)
    call_args.sglang_router_ip, call_args.sglang_router_port, call_args.engine_client = client.host, client.port, client
    prompt_length = sample.prompt_length
    out = fn(call_args, sample, params)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    if out is not sample:  # copy the returned sample's result onto the tracked one
        for field in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "status",
                      "weight_versions", "metadata", "rollout_routed_experts", "rollout_indexer_topk"):
            setattr(sample, field, getattr(out, field))
    n = sample.response_length
    if n < 1 or len(sample.tokens) != prompt_length + n:
        raise RolloutError(f"--custom-generate-function-path returned sample {sample.index} with response_length {n} "
                           f"and {len(sample.tokens)} tokens for a {prompt_length}-token prompt")
    if sample.loss_mask is None:
        sample.loss_mask = [1] * n
    if len(sample.loss_mask) != n or (sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != n):
        raise RolloutError(f"--custom-generate-function-path: sample {sample.index}'s loss_mask/rollout_log_probs "
                           f"must have response_length ({n}) entries")
    if sample.status == SampleStatus.PENDING:
        sample.status = SampleStatus.COMPLETED


async def _await(x: Any) -> Any:
    return await x


def lose_request(fleet: EngineFleet, idx: int, gen: int, error: BaseException, counters: RolloutCounters,
                 samples: int) -> None:
    """A request engine `idx` never answered (its process died; behind sglang-router, a 5xx): it is counted as
    re-issued (`samples` of them, rollout/reissued_requests) and reported to the fleet, which restarts and
    re-syncs the engine or raises RolloutError when none is left. The caller sends it again. Both transports of
    the generation loop take this one path: the built-in sender and the plugins' fleet proxy."""
    fleet.release(idx, served=False)
    counters.add(reissued=samples)
    fleet.report_failure(idx, gen, error)


class _Attempts:
    __slots__ = ("failures", "aborts", "last_error")

    def __init__(self) -> None:
        self.failures, self.aborts, self.last_error = 0, 0, None


class _WorkQueue:
    """The samples not done yet: workers take runs of pending ones, lost or aborted ones come back, finished
    ones are counted off. `stop` ends the taking (the first unrecoverable failure sets it)."""

    def __init__(self, samples: list[Sample], chunk: int, seeded_runs_of: Any = None) -> None:
        """seeded_runs_of: the args whose sample seeds a run must follow consecutively (behind sglang-router),
        or None (any run of pending samples)."""
        self.pending: deque[Sample] = deque(samples)
        self.unfinished = len(samples)
        self.chunk, self.seeded_runs_of = chunk, seeded_runs_of
        self.cond = threading.Condition()
        self.stop = threading.Event()

    def take(self) -> list[Sample]:
        """Up to `chunk` pending samples; [] once every sample is done (or the rollout stops). Behind
        sglang-router, whose requests carry one sampling_params object, only a run of samples with consecutive
        seeds (consecutive indices: a GRPO group, a whole rollout) that the engine seeds item by item."""
        args = self.seeded_runs_of
        with self.cond:
            while not self.pending and self.unfinished and not self.stop.is_set():
                self.cond.wait(0.5)  # in-flight samples may come back (lost or aborted)
            if self.stop.is_set() or not self.unfinished:
                return []
            out = [self.pending.popleft()]
            while len(out) < self.chunk and self.pending and (
                    args is None or sample_seed(args, self.pending[0].index) == sample_seed(args, out[-1].index) + 1):
                out.append(self.pending.popleft())
            return out

    def retry(self, batch: list[Sample]) -> None:
        with self.cond:
            self.pending.extend(batch)
            self.cond.notify_all()

    def done(self, n: int) -> None:
        with self.cond:
            self.unfinished -= n
            self.cond.notify_all()

    def halt(self) -> None:
        self.stop.set()  # the first failure stops new requests at once
        with self.cond:
            self.cond.notify_all()


class _Sender:
    """Sends a worker's run of samples to one engine and puts the answers on them (finished and scored); what
    the engine lost or aborted goes back to the queue. Raises RolloutError on an unrecoverable failure."""

    def __init__(self, args: Any, fleet: EngineFleet, queue: _WorkQueue, custom: Any, behind_router: bool,
                 tokenizer: Any, reward_fn: RewardFn | None, counters: RolloutCounters, engine_times: EngineTimes | None,
                 evaluation: bool, extra_params: dict[str, Any] | None, on_done: Any = None) -> None:
        """custom: the --custom-generate-function-path function (or None); behind_router: generation goes
        through sglang-router (fleet.behind_router()); on_done: called with each request's finished samples."""
        self.args, self.fleet, self.queue, self.custom, self.behind_router = args, fleet, queue, custom, behind_router
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.counters, self.engine_times, self.evaluation = counters, engine_times, evaluation
        self.extra_params = extra_params or {}
        self.on_done = on_done
        self.timeout = float(args.rollout_request_timeout)
        # --use-rollout-routing-replay: the engines return each sample's routed experts
        self.routed = {"return_routed_experts": True} if args.use_rollout_routing_replay else {}
        # and the DSA layers' selected keys (indexer top-k replay), for training only: at full size they are
        # ~371 KB per token, which an evaluation never trains on
        if args.use_rollout_indexer_replay and not evaluation:
            self.routed["return_indexer_topk"] = True
        self.attempts = {s.index: _Attempts() for s in queue.pending}

    def send(self, batch: list[Sample]) -> None:
        for s in batch:
            a = self.attempts[s.index]
            if a.failures >= MAX_FAILED_ATTEMPTS:
                raise RolloutError(f"sample {s.index} failed on {a.failures} engine attempts; last error: {a.last_error}")
            if a.aborts >= MAX_ABORTS:
                raise RolloutError(f"sample {s.index} was aborted {a.aborts} times (engines kept pausing)")
        fleet, args = self.fleet, self.args
        fleet.wait_unpaused()
        idx = fleet.acquire()
        if self.engine_times is not None:
            self.engine_times.first_use(idx)
        gen = fleet.generation(idx)
        for s in batch:
            s.attempts += 1
        params = [dict(sampling_params(args, sample_seed(args, s.index)), **self.extra_params) for s in batch]
        if self.custom is not None:
            self._send_custom(batch[0], idx, gen, params[0])
        else:
            self._send_batch(batch, idx, gen, params)

    def _lost(self, batch: list[Sample], idx: int, gen: int, error: EngineError) -> None:
        """The request never came back: the fleet restarts the engine (or raises RolloutError), then re-issue."""
        for s in batch:
            self.attempts[s.index].failures += 1
            self.attempts[s.index].last_error = error
        lose_request(self.fleet, idx, gen, error, self.counters, len(batch))
        self.queue.retry(batch)

    def _send_custom(self, sample: Sample, idx: int, gen: int, params: dict[str, Any]) -> None:
        """--custom-generate-function-path: one sample per call, to the engine chosen for it."""
        try:
            _custom_generate(self.custom, self.args, self.fleet.client(idx), sample, params)
        except EngineUnreachable as e:
            self._lost([sample], idx, gen, e)
            return
        except BaseException:
            self.fleet.release(idx, served=False)
            raise
        self.fleet.release(idx, served=True)
        apply_in_place(self.args, sample, self.evaluation)
        if self.reward_fn is not None and not self.args.group_rm:
            sample.reward = compute_reward(self.reward_fn, self.args, sample)
        self._done([sample])

    def _send_batch(self, batch: list[Sample], idx: int, gen: int, params: list[dict[str, Any]]) -> None:
        """One /generate request for the run (a list of prompts; a single prompt when it is one)."""
        try:
            client = self.fleet.generation_client(idx)  # the sglang-router, when in front
            if len(batch) == 1:
                outs = [client.generate(batch[0].prompt_tokens, params[0], return_logprob=True, timeout=self.timeout,
                                        **self.routed)]
            else:
                outs = client.generate([s.prompt_tokens for s in batch], params[0] if self.behind_router else params,
                                       return_logprob=True, timeout=self.timeout, **self.routed)
        except EngineUnreachable as e:
            self._lost(batch, idx, gen, e)
            return
        except EngineError as e:
            if not (self.behind_router and e.status >= 500):
                self.fleet.release(idx, served=False)
                raise RolloutError(f"engine {idx} rejected sample {batch[0].index}: {e.message}") from e
            # sglang-router's 5xx: the engine it chose died (it retries live ones first); the fleet restarts
            # dead engines, or raises when every engine is up (then the error is the engine's own)
            self._lost(batch, idx, gen, e)
            return
        self.fleet.release(idx, served=True)
        if not isinstance(outs, list) or len(outs) != len(batch):
            raise RolloutError(f"engine {idx} answered {len(batch)} prompts with "
                               f"{len(outs) if isinstance(outs, list) else type(outs).__name__} results")
        self._take_answers(batch, idx, outs)

    def _done(self, finished: list[Sample]) -> None:
        if self.on_done is not None:
            self.on_done(finished)
        self.counters.add(done=len(finished))
        self.queue.done(len(finished))

    def _take_answers(self, batch: list[Sample], idx: int, outs: list[dict[str, Any]]) -> None:
        args = self.args
        again: list[Sample] = []
        finished: list[Sample] = []
        for s, out in zip(batch, outs):
            finish = out["meta_info"]["finish_reason"]
            if finish["type"] == "abort":
                if str(finish.get("message", "")).startswith("engine error"):
                    # A failing forward pass fails again on retry: report it instead of looping.
                    raise RolloutError(f"engine {idx} failed on sample {s.index}: {finish['message']}")
                self.attempts[s.index].aborts += 1
                self.counters.add(aborted=1)
                again.append(s)
                continue
            self.fleet.note_version(idx, out["meta_info"].get("weight_version"))
            _finish_sample(s, out, idx, self.tokenizer, bool(args.rollout_skip_special_tokens),
                           args if self.routed else None)
            apply_in_place(args, s, self.evaluation)
            finished.append(s)
        if self.reward_fn is not None and not args.group_rm and finished:  # the request's samples scored together
            for s, reward in zip(finished, compute_rewards(self.reward_fn, args, finished)):
                s.reward = reward
        if finished:
            self._done(finished)
        if again:
            self.queue.retry(again)


def run_samples(args: Any, fleet: EngineFleet, samples: list[Sample], tokenizer: Any, reward_fn: RewardFn | None,
                progress: RolloutCounters | None = None, engine_times: EngineTimes | None = None,
                evaluation: bool = False, extra_params: dict[str, Any] | None = None,
                on_done: Any = None) -> RolloutCounters:
    """Generate (and score) every sample in place. Raises RolloutError on the first unrecoverable failure.
    Each finished sample passes through --rollout-sample-hook-path before its reward. extra_params: sampling
    params no rollout flag sets (an eval set's min_new_tokens, repetition_penalty), added to every request's;
    on_done(samples): called (on a sending thread) with each request's finished and scored samples.

    Workers take up to `samples_per_request` pending samples each and send them as one /generate request
    (a list of prompts; a single prompt when it is one); lost or aborted samples go back to the queue.
    At most --max-concurrency samples are in flight."""
    counters = progress or RolloutCounters()
    custom = load_generate_function(args)
    chunk = 1 if custom is not None else samples_per_request(args, fleet, len(samples))
    behind_router = bool(fleet.behind_router())
    queue = _WorkQueue(samples, chunk, args if behind_router else None)
    sender = _Sender(args, fleet, queue, custom, behind_router, tokenizer, reward_fn, counters, engine_times,
                     evaluation, extra_params, on_done)

    def worker() -> None:
        try:
            while True:
                batch = queue.take()
                if not batch:
                    return
                sender.send(batch)
        except BaseException:
            queue.halt()
            raise

    count = fleet.num_engines()
    concurrency = request_concurrency(args, int(count) if count is not None else 1)
    workers = max(1, min(concurrency // chunk, -(-len(samples) // chunk)))
    if workers == 1:  # e.g. one batched request per engine and one engine: on this thread (no thread to start;
        worker()      # the generation loop's executor thread, idle between rollouts, keeps its HTTP connection)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") as pool:
            futures = [pool.submit(worker) for _ in range(workers)]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            errors = [f.exception() for f in finished if f.exception() is not None]
            if errors:
                queue.stop.set()  # in-flight requests finish; nothing new is sent
                raise errors[0]
    missing = [s.index for s in samples if s.status == SampleStatus.PENDING]
    if missing:
        raise RolloutError(f"{len(missing)} samples never completed (e.g. {missing[:5]}); this is a bug")
    return counters


def rollout_metrics(samples: list[Sample], counters: RolloutCounters, elapsed: float) -> dict[str, float]:
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


class FleetGroups:
    """The built-in transport as a group generator of the generation loop (slime.rollout.streaming): each
    submission's samples, in submission order, go out as batched /generate requests over the fleet
    (`run_samples`, on a worker thread), so the requests and their order (which the embedded engine's batching,
    and with it the seeded outputs, depend on) are those of one `run_samples` over the submitted samples. A
    group's task finishes once its last sample is generated and scored, with its --group-rm reward (training).
    Nothing is cut short: at `abort` the groups still generating finish and are dropped (this path has no
    partial rollout to hand them back to)."""

    def __init__(self, args: Any, fleet: EngineFleet, tokenizer: Any, reward_fn: RewardFn | None,
                 counters: RolloutCounters, engine_times: EngineTimes | None = None, evaluation: bool = False,
                 extra_params: dict[str, Any] | None = None) -> None:
        self.args, self.fleet, self.tokenizer, self.reward_fn = args, fleet, tokenizer, reward_fn
        self.counters, self.engine_times, self.evaluation = counters, engine_times, evaluation
        self.extra_params = extra_params
        self.group_rewards = not evaluation and reward_fn is not None and bool(args.group_rm)
        self.jobs: list[asyncio.Future] = []
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Future] = set()

    def submit_generate_tasks(self, groups: list[list[Sample]]) -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in groups]
        group_of = {s.index: i for i, g in enumerate(groups) for s in g}
        left = [len(g) for g in groups]
        lock = threading.Lock()

        def finished(samples: list[Sample]) -> None:  # on a sending thread, before the samples count as done
            with lock:
                whole = []
                for s in samples:
                    left[group_of[s.index]] -= 1
                    if not left[group_of[s.index]]:
                        whole.append(group_of[s.index])
            for i in whole:
                if self.group_rewards:  # --group-rm: the reward sees a prompt's samples together
                    for s, r in zip(groups[i], compute_group_rewards(self.reward_fn, self.args, groups[i])):
                        s.reward = r
                loop.call_soon_threadsafe(_settle, futures[i], groups[i], None)

        samples = [s for g in groups for s in g]
        job = loop.run_in_executor(None, functools.partial(
            run_samples, self.args, self.fleet, samples, self.tokenizer, self.reward_fn, self.counters,
            self.engine_times, self.evaluation, self.extra_params, finished))
        job.add_done_callback(functools.partial(_fail_unfinished, futures))
        self.jobs.append(job)
        self.pendings.update(futures)
        self.remaining_batch_size += len(groups)

    async def abort(self) -> list[list[Sample]]:
        jobs, self.jobs = self.jobs, []
        await asyncio.gather(*jobs, return_exceptions=True)  # the groups it drops: their errors matter no more
        return []


def _fail_unfinished(futures: list[asyncio.Future], job: asyncio.Future) -> None:
    """A failed (or cancelled) submission fails its unfinished groups, so the loop raises instead of waiting."""
    error = RolloutError("the generation job was cancelled") if job.cancelled() else job.exception()
    if error is not None:
        for f in futures:
            _settle(f, None, error)


def _settle(future: asyncio.Future, group: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(group)
    else:
        future.set_exception(error)
        future.exception()  # every group of the submission carries it; the loop raises it once


async def _stream_all(args: Any, generator: FleetGroups, source: Any, target: int) -> list[list[Sample]]:
    """Every group `source(target)` gives, through the generation loop (no filter: each is kept)."""
    try:
        groups, _ = await stream_groups(args, generator, source, target, target, None, MetricGatherer())
    finally:
        await generator.abort()
    sort_groups(groups)
    return groups


def generate_groups(args: Any, generator: FleetGroups, groups: list[list[Sample]]) -> list[Sample]:
    """Generate (and score) the given groups through the generation loop; their samples in order."""
    given = iter([groups])
    out = run(_stream_all(args, generator, lambda n: next(given), len(groups)))
    return [s for g in out for s in g]


def generate_rollout(args: Any, fleet: EngineFleet, data_source: Any, tokenizer: Any, reward_fn: RewardFn | None,
                     progress: RolloutCounters | None = None,
                     health: dict[int, Any] | None = None) -> tuple[list[Sample], dict[str, float]]:
    """--rollout-batch-size prompt groups, every sample generated and rewarded, through the generation loop
    (slime.rollout.streaming) over the built-in transport (FleetGroups). Dynamic sampling, over-sampling and
    partial rollout run on the same loop over upstream's transport, which the rollout manager picks for them
    (slime.rollout.sglang_rollout; settings.STREAMING_FLAGS). health: the engines' /health replies read just
    before (EngineTimes starts from them)."""
    given = [f"--{name.replace('_', '-')}" for name in STREAMING_FLAGS if getattr(args, name)]
    if given:
        raise RolloutError(f"{', '.join(given)}: run by slime.rollout.sglang_rollout.generate_rollout (the rollout "
                           "manager picks it for these flags), not by the built-in generate_rollout")
    if not args.rollout_batch_size:
        raise RolloutError("--rollout-batch-size is required (prompts per rollout)")
    n, target = args.n_samples_per_prompt, args.rollout_batch_size
    t0 = time.perf_counter()
    engine_times = EngineTimes(fleet, health)
    counters = progress or RolloutCounters()
    items = data_source.next_batch(target)
    indices = data_source.take_sample_indices(len(items) * n)
    fresh = make_samples(items, n, indices)
    groups = [fresh[i:i + n] for i in range(0, len(fresh), n)]
    samples = generate_groups(args, FleetGroups(args, fleet, tokenizer, reward_fn, counters, engine_times), groups)
    check_exactly_once(samples, indices)
    metrics = rollout_metrics(samples, counters, time.perf_counter() - t0)
    metrics.update(engine_times.metrics())
    return samples, metrics
