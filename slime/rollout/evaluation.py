"""Evaluation rollouts: every prompt of each eval set (`--eval-prompt-data NAME PATH`, or the sets of
`--eval-config`), `n_samples_per_eval_prompt` responses each, sampled with the set's settings and scored by
its reward (slime.rollout.eval_datasets: a config entry's own value, its defaults, then the eval flags
`--n-samples-per-eval-prompt`, `--eval-temperature`, `--eval-top-p`, `--eval-top-k`, `--eval-max-response-len`,
`--eval-min-new-tokens`, each eval flag defaulting to its rollout flag).

train.py evaluates before the first rollout (unless --skip-eval-before-train) and after every
--eval-interval rollouts, on the weights the engines then hold; the metrics go to metrics.jsonl as
records with `"kind": "eval"` and `eval_step` = rollouts trained so far, and into the report.
Eval samples use their own sample indices (and so their own sampling seeds), the same at every eval,
so successive evals differ by the weights only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from slime.rollout import rm_hub
from slime.rollout.data_source import JsonlDataSource, make_samples
from slime.rollout.eval_datasets import EvalDataset, eval_dataset_list, resolve_eval_dataset
from slime.rollout.errors import RolloutError
from slime.rollout.generate import FleetGroups, RolloutCounters, generate_groups
from slime.rollout.rewards import reward_value
from slime.rollout.sample import SampleStatus

EVAL_INDEX_BASE = 1 << 48  # eval sample indices (seeds) never meet the training ones


@dataclass
class EvalSet:
    name: str
    source: JsonlDataSource
    config: EvalDataset | None = None  # the set's own settings (None: the eval flags')


def load_eval_set(args: argparse.Namespace, d: EvalDataset, tokenizer: Any) -> EvalSet:
    """One eval set's prompts, read with the set's keys and chat-template settings."""
    return EvalSet(d.name, JsonlDataSource(
        d.path, tokenizer, d.input_key, d.label_key, d.metadata_key, bool(d.apply_chat_template), shuffle=False,
        seed=args.rollout_seed, max_prompt_len=args.eval_max_prompt_len or args.rollout_max_prompt_len,
        chat_template_kwargs=d.apply_chat_template_kwargs, tool_key=d.tool_key), d)


def load_eval_sets(args: argparse.Namespace, tokenizer: Any) -> list[EvalSet]:
    """Every eval set's prompts."""
    return [load_eval_set(args, d, tokenizer) for d in eval_dataset_list(args)]


def evaluate(args: argparse.Namespace, fleet: Any, sets: list[EvalSet], tokenizer: Any, reward_fn: Any,
             data: dict | None = None) -> dict[str, float]:
    """Generate and score every eval set with its settings; returns eval/<name>/... metrics. data: filled with
    upstream's {set: {"rewards", "truncated", "samples"}} (for --custom-eval-rollout-log-function-path)."""
    metrics: dict[str, float] = {}
    base = EVAL_INDEX_BASE
    for s in sets:
        config = s.config or resolve_eval_dataset(args, {"name": s.name, "path": s.source.path})
        # the set's rm_type / custom_rm_path reach the reward through the sample (rm_hub.async_rm reads them)
        set_reward = rm_hub.async_rm if config.overrides_reward(args) else reward_fn
        if set_reward is None:
            raise RolloutError("evaluation needs a reward: pass --rm-type or --custom-rm-path")
        sampling = config.rollout_args(args)
        n = config.n_samples_per_eval_prompt
        t0 = time.perf_counter()
        items = s.source.next_batch(len(s.source))  # no shuffle: every prompt once, in file order
        fresh = make_samples(items, n, range(base, base + len(items) * n))
        for x in fresh:
            config.prepare(x)
        base += len(items) * n
        # the generation loop over the built-in transport, as a training rollout (one group per prompt)
        generator = FleetGroups(sampling, fleet, tokenizer, set_reward, RolloutCounters(), evaluation=True,
                                extra_params=config.extra_sampling_params())
        samples = generate_groups(sampling, generator, [fresh[i:i + n] for i in range(0, len(fresh), n)])
        rewards = [reward_value(x.reward, sampling.reward_key) for x in samples]
        lengths = [x.response_length for x in samples]
        prefix = f"eval/{s.name}"
        metrics[f"{prefix}/reward_mean"] = statistics.fmean(rewards)
        metrics[f"{prefix}/reward_std"] = statistics.pstdev(rewards)
        metrics[f"{prefix}/response_len_mean"] = statistics.fmean(lengths)
        metrics[f"{prefix}/truncated_ratio"] = sum(x.status == SampleStatus.TRUNCATED for x in samples) / len(samples)
        metrics[f"{prefix}/samples"] = float(len(samples))
        metrics[f"time/eval_{s.name}"] = time.perf_counter() - t0
        if data is not None:
            data[s.name] = {"rewards": rewards, "samples": samples,
                            "truncated": [int(x.status == SampleStatus.TRUNCATED) for x in samples]}
    return metrics


def eval_steps(args: argparse.Namespace, start_rollout_id: int) -> set[int]:
    """Rollouts trained (0 = before the first) after which train.py evaluates."""
    if args.eval_interval is None:
        return set()
    steps = {k for k in range(start_rollout_id + 1, args.num_rollout + 1) if k % args.eval_interval == 0}
    if start_rollout_id == 0 and not args.skip_eval_before_train:
        steps.add(0)
    return steps
