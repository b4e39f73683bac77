"""Upstream slime's rollout module and its contracts, for plugins (`--rollout-function-path`,
`--custom-generate-function-path`) and the rollouts that use them.

    state = GenerateState(args)                    # tokenizer, processor, semaphore, sampling_params
    sample = await generate(args, sample, params)  # SGLang text /generate at the router, one turn
    out = await generate_and_rm(args, sample, params, evaluation=False)
    generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | RolloutFnEvalOutput

Requests go to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` (the rollout manager
sets these to its fleet proxy, slime.rollout.fleet_proxy: the requests spread over the engines, one lost to a
dead engine re-sent once the fleet has restarted it) with `return_logprob`; the answer's
`meta_info.output_token_logprobs` ([[logprob, token_id, ...], ...]) and `meta_info.finish_reason.type`
fill the sample through `Sample.append_response_tokens`. A group's samples are generated concurrently,
at most --sglang-server-concurrency x engines in flight; the rollout keeps the first
--rollout-batch-size groups to finish that pass --dynamic-sampling-filter-path, submitting
--over-sampling-batch-size more whenever too few are pending, and aborts the rest: the engines end
their running requests (`/abort_request`), which come back with the tokens generated so far; with
--partial-rollout those groups go back to the data source and continue from there in a later rollout.
The rollout manager runs this loop for a built-in run that uses dynamic sampling, over-sampling or
partial rollout too (slime.rollout.plugin_rollout).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from argparse import Namespace
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.filter_hub.base_types import MetricGatherer
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.rollout.streaming import sort_groups, stream_groups
from slime.utils.async_utils import run
from slime.utils.http_utils import post, request_limit
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.types import Sample

__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout",
           "eval_rollout", "get_model_url"]

logger = logging.getLogger(__name__)


def get_model_url(args: Namespace, model_name: str | None = None, endpoint: str = "/generate") -> str:
    """The router URL (a named model's router under --sglang-config, when the run has several)."""
    routers = getattr(args, "sglang_model_routers", None) or {}
    if model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


class GenerateState(metaclass=SingletonMeta):
    """The process-wide generation state: tokenizer, processor, request semaphore, default sampling params."""

    def __init__(self, args: Namespace) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.processor = None  # text-only models here; multimodal processors are not loaded
        self.semaphore = asyncio.Semaphore(request_limit(args))
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=getattr(args, "rollout_stop", None),
            stop_token_ids=getattr(args, "rollout_stop_token_ids", None),
            skip_special_tokens=bool(getattr(args, "rollout_skip_special_tokens", False)),
            no_stop_trim=True, spaces_between_special_tokens=False)
        self.sampling_params = {k: v for k, v in self.sampling_params.items() if v is not None}
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, groups: list[list[Sample]]) -> None:
        for group in groups:
            self.pendings.add(asyncio.ensure_future(
                generate_and_rm_group(self.args, group, sampling_params=self.sampling_params.copy(), evaluation=False)))
        self.remaining_batch_size += len(groups)


def _prompt_ids(sample: Sample, tokenizer: Any) -> list[int]:
    if sample.tokens:
        return list(sample.tokens)
    return list(tokenizer.encode(sample.prompt, add_special_tokens=False))


async def generate(args: Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One model turn for `sample` (its tokens so far are the prompt), appended with its log-probs."""
    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"sample {sample.index} is {sample.status.value}; only pending or aborted samples generate")
    prompt_ids = _prompt_ids(sample, state.tokenizer)
    params = dict(sampling_params)
    params["max_new_tokens"] = int(params["max_new_tokens"]) - sample.response_length
    if params["max_new_tokens"] < 0:
        raise ValueError(f"sample {sample.index} already has {sample.response_length} response tokens, more than "
                         "--rollout-max-response-len")
    if params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    if not sample.tokens:
        sample.tokens = prompt_ids
    payload = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True  # whole sequence: append_response_tokens keeps it
    if getattr(args, "use_rollout_indexer_replay", False):
        payload["return_indexer_topk"] = True  # the DSA layers' keys per fed token (meta_info["indexer_topk"])
    output = await post(get_model_url(args), payload)
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  trainable=True, meta_info=output["meta_info"], text=output.get("text", ""))
    return sample


async def _custom_generate(fn: Any, args: Namespace, sample: Sample, params: dict, evaluation: bool) -> Any:
    takes_evaluation = "evaluation" in inspect.signature(fn).parameters
    out = fn(args, sample, params, evaluation=evaluation) if takes_evaluation else fn(args, sample, params)
    return await out if inspect.isawaitable(out) else out


async def generate_and_rm(args: Namespace, sample: Sample, sampling_params: dict[str, Any],
                          evaluation: bool = False) -> Sample | list[Sample]:
    """Generate (the sample's own generate_function_path, else --custom-generate-function-path, else
    `generate`), apply --rollout-sample-hook-path, then reward it unless --group-rm or the generate function
    already did."""
    if getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout", False) \
            and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length  # the earlier part came from older weights
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample  # finished before (a partial rollout given back)
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = sample.generate_function_path or getattr(args, "custom_generate_function_path", None)
        if path:
            sample = await _custom_generate(load_function(path), args, sample, sampling_params, evaluation)
        else:
            sample = await generate(args, sample, sampling_params)
    sample = await apply_rollout_sample_hooks(  # --rollout-sample-hook-path, before the reward (upstream's order)
        args, sample, paths=getattr(args, "rollout_sample_hook_path", None) or [], evaluation=evaluation)
    if getattr(args, "group_rm", False):
        return sample
    if isinstance(sample, list):
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        todo = [s for s in sample if s.reward is None]
        for s, reward in zip(todo, await batched_async_rm(args, todo)):
            s.reward = reward
        return sample
    if sample.status != Sample.Status.ABORTED and sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(args: Namespace, group: list[Sample], sampling_params: dict[str, Any],
                                evaluation: bool = False) -> list:
    """A prompt's samples, concurrently; with --group-rm one batched reward call for the group."""
    state = GenerateState(args)
    if state.aborted:
        return group
    group = list(await asyncio.gather(*(generate_and_rm(args, s, sampling_params.copy(), evaluation=evaluation)
                                        for s in group)))
    if not state.aborted and getattr(args, "group_rm", False):
        for s, reward in zip(group, await batched_async_rm(args, group)):
            s.reward = reward
    return group


ABORT_RETRY_S = 0.5  # abort again while groups are pending: a request sent just before the abort may still run


async def abort_engines(args: Namespace) -> None:
    """`POST /abort_request {"abort_all": true}` to every engine (args.rollout_engine_clients, set by the rollout
    manager): their running and queued requests end now with finish_reason abort and the tokens so far."""

    async def one(client: Any) -> None:
        try:
            await asyncio.to_thread(client.abort_all)
        except Exception as e:  # noqa: BLE001 - an engine that is down has nothing to abort
            logger.warning("abort_request to %s failed: %s", getattr(client, "url", client), e)

    await asyncio.gather(*(one(c) for c in getattr(args, "rollout_engine_clients", None) or []))


async def abort(args: Namespace, rollout_id: int) -> list[list[Sample]]:
    """Stop the groups still generating: samples not sent yet are not sent, the engines abort the running
    ones (partial responses come back, status ABORTED); with --partial-rollout every such group is returned
    to be given back to the data source (its partial samples marked with metadata["start_rollout_id"])."""
    state = GenerateState(args)
    state.aborted = True
    leftover: list[list[Sample]] = []
    while state.pendings:
        await abort_engines(args)
        done, state.pendings = await asyncio.wait(state.pendings, timeout=ABORT_RETRY_S,
                                                  return_when=asyncio.FIRST_COMPLETED)
        if getattr(args, "partial_rollout", False):
            for task in done:
                group = task.result()
                for s in group:
                    if s.response and "start_rollout_id" not in s.metadata:
                        s.metadata["start_rollout_id"] = rollout_id
                leftover.append(group)
    return leftover


async def generate_rollout_async(args: Namespace, rollout_id: int, data_source: Any
                                 ) -> tuple[RolloutFnTrainOutput, list[list[Sample]]]:
    """--rollout-batch-size groups: the first to finish that the dynamic-sampling filter keeps (the one
    generation loop, slime.rollout.streaming, over this module's per-group tasks)."""
    state = GenerateState(args)
    path = getattr(args, "dynamic_sampling_filter_path", None)
    gatherer = MetricGatherer()
    target = int(args.rollout_batch_size)
    batch = int(getattr(args, "over_sampling_batch_size", None) or target)
    data, every = await stream_groups(args, state, data_source, target, batch, load_function(path) if path else None,
                                      gatherer)
    leftover = await abort(args, rollout_id)
    sort_groups(data)
    sort_groups(every)
    state.reset()
    if getattr(args, "rollout_sample_filter_path", None):
        load_function(args.rollout_sample_filter_path)(args, data)
    if getattr(args, "rollout_all_samples_process_path", None):
        load_function(args.rollout_all_samples_process_path)(args, every, data_source)
    return RolloutFnTrainOutput(samples=data, metrics=gatherer.collect()), leftover


async def _eval_set(args: Namespace, eval_set: Any) -> dict[str, list]:
    """An eval set's prompts, n_samples_per_eval_prompt samples each, with the set's sampling params, reward and
    generate function: upstream's {"rewards", "truncated", "samples"} in sample order."""
    from slime.rollout.data_source import make_samples

    key = args.eval_reward_key or args.reward_key
    config = eval_set.config
    params = dict(spaces_between_special_tokens=False, **config.sampling_params(args))
    items = eval_set.source.next_batch(len(eval_set.source))
    n = int(config.n_samples_per_eval_prompt)
    samples = make_samples(items, n, range(len(items) * n))
    for s in samples:
        config.prepare(s)
    samples = list(await asyncio.gather(*(generate_and_rm(args, s, params.copy(), evaluation=True) for s in samples)))
    return {"rewards": [s.reward if not key else s.reward[key] for s in samples],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples], "samples": samples}


async def eval_rollout(args: Namespace, rollout_id: int) -> tuple[RolloutFnEvalOutput, list]:
    """Every prompt of each eval set (--eval-prompt-data or --eval-config), its n_samples_per_eval_prompt samples
    each, with the set's sampling params, reward and generate function (slime.rollout.eval_datasets)."""
    from slime.rollout.evaluation import load_eval_sets

    state = GenerateState(args)
    return RolloutFnEvalOutput(data={s.name: await _eval_set(args, s) for s in load_eval_sets(args, state.tokenizer)}), []


async def eval_rollout_single_dataset(args: Namespace, rollout_id: int, dataset_cfg: Any) -> dict[str, dict[str, list]]:
    """Upstream's one-set evaluation: `dataset_cfg` (slime.utils.eval_config.EvalDatasetConfig, or this project's
    EvalDataset) -> {name: {"rewards", "truncated", "samples"}}, as eval_rollout does it for each of its sets."""
    from slime.rollout.evaluation import load_eval_set

    if args.group_rm:
        raise ValueError("eval_rollout_single_dataset: --group-rm is not supported for evaluation (upstream's "
                         "rule too); score eval samples one at a time")
    dataset = dataset_cfg.to_eval_dataset() if hasattr(dataset_cfg, "to_eval_dataset") else dataset_cfg
    eval_set = load_eval_set(args, dataset, GenerateState(args).tokenizer)
    return {dataset.name: await _eval_set(args, eval_set)}


def generate_rollout(args: Namespace, rollout_id: int, data_source: Any, evaluation: bool = False
                     ) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Upstream's default rollout function (`--rollout-function-path slime.rollout.sglang_rollout.generate_rollout`)."""
    if not getattr(args, "rollout_global_dataset", True):  # upstream asserts it too
        raise ValueError("slime.rollout.sglang_rollout.generate_rollout reads the prompts of --prompt-data; under "
                         "--disable-rollout-global-dataset name a --rollout-function-path that manages its data")
    if evaluation:
        return run(eval_rollout(args, rollout_id))[0]
    output, leftover = run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    if leftover:
        data_source.add_samples(leftover)
    return output
