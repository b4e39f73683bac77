"""Upstream slime's rollout flags that act on generated samples, on both rollout paths (the built-in loop and
upstream's sglang_rollout) over in-process embedded engines:

- --rollout-sample-hook-path: hooks run in order on every generated sample, before its reward, in training and
  evaluation, with the keywords their signatures name;
- --eval-config (upstream's YAML of eval sets with their own settings) and --eval-min-new-tokens: resolution equal
  to upstream's recorded one, every upstream key honored or refused in one line, and each set's settings reaching
  the engine on the built-in evaluate and on upstream's sglang_rollout.eval_rollout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from slime.config.eval_config import HONORED_KEYS, REFUSED_KEYS
from slime.config.rollout_args import RolloutArgumentError, rollout_defaults, validate_rollout_args
from slime.rollout.generate import generate_rollout
from slime.rollout.rewards import get_reward_fn
from slime.rollout.sample_hooks import SampleHookError, apply_rollout_sample_hooks, set_current_rollout_id
from slime.utils.types import Sample
from tests.test_rollout import _Fleet, _rollout_setup, engines, tokenizer  # noqa: F401 (fixtures)


# ------------------------------------------------------------------ --rollout-sample-hook-path
HOOKS = ["tests.test_upstream_rollout_flags:answer_with_label", "tests.test_upstream_rollout_flags:record_call"]


def answer_with_label(args, sample):
    """Sync, edits in place, takes no keywords: the reward must then score the label against itself."""
    sample.metadata["seen_response"] = sample.response
    sample.metadata["reward_when_hooked"] = sample.reward
    sample.response = sample.label


async def record_call(args, sample, *, rollout_id=None, evaluation=False):
    """Async, returns a new Sample: the rollout must return it (its fields), in order after the first hook."""
    out = copy.deepcopy(sample)
    out.metadata["calls"] = sample.metadata.get("calls", []) + [(rollout_id, evaluation, "seen_response" in
                                                                  sample.metadata)]
    return out


def exact(args, sample, **kwargs):
    return 1.0 if sample.response == sample.label else 0.0


def not_a_sample(args, sample, **kwargs):
    return {"response": "x"}


def _setup(tmp_path, tokenizer):  # noqa: F811 (fixtures)
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.rm_type, args.custom_rm_path = None, "tests.test_upstream_rollout_flags:exact"
    args.rollout_batch_size, args.n_samples_per_prompt = 2, 2
    return args, ds


def _check(samples, rollout_id, evaluation):
    assert samples
    for s in samples:
        assert s.metadata["reward_when_hooked"] is None  # hooks run before the reward
        assert s.response == s.label and s.reward == 1.0
        assert s.metadata["calls"] == [(rollout_id, evaluation, True)]


def test_builtin_rollout_applies_hooks_before_the_reward(engines, tmp_path, tokenizer):  # noqa: F811 (fixtures)
    _, clients = engines
    args, ds = _setup(tmp_path, tokenizer)
    args.rollout_sample_hook_path = list(HOOKS)
    set_current_rollout_id(7)
    try:
        samples, _ = generate_rollout(args, _Fleet(clients), ds, tokenizer, get_reward_fn(args))
    finally:
        set_current_rollout_id(None)
    assert [s.index for s in samples] == list(range(4))
    _check(samples, 7, False)
    assert all(s.metadata["seen_response"] != s.label for s in samples)  # the model's own answers score 0


def test_builtin_evaluation_applies_hooks_with_evaluation_true(engines, tmp_path, tokenizer):  # noqa: F811 (fixtures)
    from slime.rollout.evaluation import evaluate, load_eval_sets

    _, clients = engines
    args, _ = _setup(tmp_path, tokenizer)
    small = tmp_path / "eval.jsonl"
    small.write_text("".join(open(args.prompt_data).readlines()[:3]))
    args.eval_prompt_data = ["syn", str(small)]
    args.rollout_sample_hook_path = list(HOOKS)
    data: dict = {}
    set_current_rollout_id(3)
    try:
        metrics = evaluate(args, _Fleet(clients), load_eval_sets(args, tokenizer), tokenizer, get_reward_fn(args), data)
    finally:
        set_current_rollout_id(None)
    _check(data["syn"]["samples"], 3, True)
    assert metrics["eval/syn/reward_mean"] == 1.0


def test_plugin_rollout_applies_hooks_before_the_reward(engines, tmp_path, tokenizer):  # noqa: F811 (fixtures)
    from slime.rollout.plugin_rollout import make_data_source, plugin_args, run_plugin_rollout
    from slime.rollout.sglang_rollout import GenerateState

    path, clients = engines
    args, ds = _setup(tmp_path, tokenizer)
    args.hf_checkpoint = path
    args.rollout_function_path = "slime.rollout.sglang_rollout.generate_rollout"
    args.rollout_sample_hook_path = list(HOOKS)
    args = plugin_args(args, clients[0].url, 1, clients[:1])
    GenerateState.clear_instances()
    set_current_rollout_id(5)
    try:
        samples, _ = run_plugin_rollout(args, 5, make_data_source(args, ds, tokenizer))
    finally:
        GenerateState.clear_instances()
        set_current_rollout_id(None)
    assert len(samples) == 4 and all(s.metadata["seen_response"] != s.label for s in samples)
    _check(samples, 5, False)


def test_hook_results_are_checked_and_list_shape_kept():
    import asyncio
    from types import SimpleNamespace

    args = SimpleNamespace(rollout_sample_hook_path=["tests.test_upstream_rollout_flags:not_a_sample"])
    with pytest.raises(SampleHookError, match=r"^Rollout sample hook 'tests.test_upstream_rollout_flags:not_a_sample' "
                                              r"returned dict, expected Sample or None\.$"):
        asyncio.run(apply_rollout_sample_hooks(args, Sample(index=0)))
    args.rollout_sample_hook_path = ["tests.test_upstream_rollout_flags:record_call"]
    nested = [Sample(index=0), [Sample(index=1), Sample(index=2)]]
    out = asyncio.run(apply_rollout_sample_hooks(args, nested, rollout_id=4, evaluation=True))
    assert [type(x).__name__ for x in out] == ["Sample", "list"] and len(out[1]) == 2
    assert out[1][1].index == 2 and out[1][1].metadata["calls"] == [(4, True, False)]


def test_flag_is_repeatable_and_checked():
    from slime.config.arguments import build_parser

    ns = build_parser().parse_args(["--rollout-sample-hook-path", HOOKS[0], "--rollout-sample-hook-path", HOOKS[1]])
    assert ns.rollout_sample_hook_path == HOOKS
    with pytest.raises(RolloutArgumentError, match="--rollout-sample-hook-path"):
        validate_rollout_args(rollout_defaults(rollout_sample_hook_path=["tests.test_upstream_rollout_flags:missing"]))


# ------------------------------------------------------------------ --eval-config, --eval-min-new-tokens
UPSTREAM = json.loads((Path(__file__).parent / "data" / "upstream_eval_config.json").read_text())


def _validated(tmp_path, config, **flags):
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    args = rollout_defaults(eval_config=str(path), **flags)
    return validate_rollout_args(args)


def test_every_upstream_key_is_honored_or_refused():
    fields = set(UPSTREAM["EvalDatasetConfig_fields"])
    assert len(fields) == 32 and fields == set(HONORED_KEYS) | set(REFUSED_KEYS)
    assert not set(HONORED_KEYS) & set(REFUSED_KEYS)


def test_resolution_equals_upstreams(tmp_path):
    """Entry value, then eval.defaults, then the flags (eval flag, then rollout flag): upstream's recorded output."""
    flags = {k: v for k, v in UPSTREAM["args"].items() if k not in ("multimodal_keys", "eval_custom_rm_path")}
    args = _validated(tmp_path, UPSTREAM["config"], **flags)
    assert args.eval_prompt_data == ["aime", "aime.jsonl", "gpqa", "gpqa.jsonl"]  # as upstream rewrites it
    for ours, theirs, metadata in zip(args.eval_datasets, UPSTREAM["resolved"], UPSTREAM["metadata"]):
        for key in HONORED_KEYS:
            assert getattr(ours, key) == theirs[key], (ours.name, key)
        assert ours.metadata({"orig": 1}) == metadata


@pytest.mark.parametrize("config, needle", [
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "app_service": "http://x"}]}},
     "dataset 'a' key 'app_service' is refused: generation through an external AppServer"),
    ({"eval": {"defaults": {"multimodal_keys": {"image": "img"}}, "datasets": {"a": {"path": "a.jsonl"}}}},
     "eval.defaults key 'multimodal_keys' is refused"),
    ({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "temprature": 0.5}]}}, "unknown key 'temprature'"),
    ({"eval": {"datasets": [{"name": "a"}]}}, "dataset 'a' has no `path`"),
    ({"eval": {"datasets": [{"path": "a.jsonl"}]}}, "needs a `name`"),
    ({"eval": {"datasets": []}}, "defines no datasets"),
    ({"datasets": {"a": {"path": "a.jsonl", "n_samples_per_eval_prompt": "4"}}}, "must be an integer"),
    ({"datasets": {"a": {"path": "a.jsonl"}, "b": {"path": "${oc.env:X}"}}}, "interpolation"),
])
def test_bad_configs_are_refused_in_one_line(tmp_path, config, needle):
    with pytest.raises(RolloutArgumentError, match="--eval-config") as e:
        _validated(tmp_path, config)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_eval_min_new_tokens_is_checked():
    with pytest.raises(RolloutArgumentError, match="--eval-min-new-tokens must be >= 0"):
        validate_rollout_args(rollout_defaults(eval_min_new_tokens=-1))


def length_plus_bonus(args, sample, **kwargs):
    return float(sample.response_length + sample.metadata["bonus"])


STOP_ALMOST_ALL = list(range(2, 512))  # every token but 0 and 1 stops: responses end after ~1 token


def _eval_setup(tmp_path, tokenizer, engines, **config_flags):  # noqa: F811 (fixtures)
    args, _ = _rollout_setup(tmp_path, tokenizer)
    small = tmp_path / "eval.jsonl"
    small.write_text("".join(open(args.prompt_data).readlines()[:3]))
    args.hf_checkpoint = engines[0]
    args.rollout_stop_token_ids = STOP_ALMOST_ALL
    config = {"eval": {"defaults": {"max_response_len": 6}, "datasets": [
        {"name": "bonus", "path": str(small), "n_samples_per_eval_prompt": 2, "max_response_len": 3,
         "min_new_tokens": 0,
         "custom_rm_path": "tests.test_upstream_rollout_flags:length_plus_bonus", "metadata_overrides": {"bonus": 100}},
        {"name": "long", "path": str(small), "min_new_tokens": 4},
        {"name": "plain", "path": str(small)}]}}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    args.eval_config = str(path)
    for k, v in config_flags.items():
        setattr(args, k, v)
    return validate_rollout_args(args)


def _check_sets(data, min_flag=None):
    bonus, long, plain = data["bonus"]["samples"], data["long"]["samples"], data["plain"]["samples"]
    assert len(bonus) == 6 and len(long) == len(plain) == 3
    assert all(1 <= s.response_length <= 3 for s in bonus)
    assert data["bonus"]["rewards"] == [s.response_length + 100.0 for s in bonus]  # the set's reward and metadata
    assert all(s.response_length >= 4 for s in long)  # min_new_tokens held the stop tokens off
    assert all(r is not None and r < 100 for r in data["long"]["rewards"])  # the run's reward (synthetic)
    if min_flag is None:
        assert all(s.response_length < 4 for s in plain)  # without it the stop tokens end responses early
    else:
        assert all(s.response_length >= min_flag for s in plain)


@pytest.mark.parametrize("min_flag", [None, 5])
def test_builtin_evaluate_uses_each_sets_settings(engines, tmp_path, tokenizer, min_flag):  # noqa: F811 (fixtures)
    from slime.rollout.evaluation import evaluate, load_eval_sets

    args = _eval_setup(tmp_path, tokenizer, engines, eval_min_new_tokens=min_flag)
    data: dict = {}
    metrics = evaluate(args, _Fleet(engines[1]), load_eval_sets(args, tokenizer), tokenizer, get_reward_fn(args), data)
    _check_sets(data, min_flag)
    assert metrics["eval/bonus/samples"] == 6.0


def test_plugin_eval_rollout_uses_each_sets_settings(engines, tmp_path, tokenizer):  # noqa: F811 (fixtures)
    from slime.rollout.plugin_rollout import plugin_args
    from slime.rollout.sglang_rollout import GenerateState, eval_rollout
    from slime.utils.async_utils import run

    args = _eval_setup(tmp_path, tokenizer, engines, eval_min_new_tokens=5)
    args = plugin_args(args, engines[1][0].url, 1, engines[1][:1])
    GenerateState.clear_instances()
    try:
        out, _ = run(eval_rollout(args, 0))
    finally:
        GenerateState.clear_instances()
    _check_sets(out.data, 5)


def test_preflight_reads_each_sets_own_keys(tmp_path):
    from slime.config.preflight_inputs import PreflightError, check_eval_prompts

    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    config = {"eval": {"datasets": [{"name": "q", "path": str(data), "input_key": "question", "label_key": "answer"}]}}
    check_eval_prompts(_validated(tmp_path, config, rm_type="math"))  # the set's keys: no complaint
    with pytest.raises(PreflightError, match="has no key 'prompt'"):  # the flags' keys would not find the prompt
        check_eval_prompts(validate_rollout_args(rollout_defaults(eval_prompt_data=["q", str(data)], rm_type="math")))


def test_plugin_eval_rollout_single_dataset_uses_the_sets_settings(engines, tmp_path, tokenizer):  # noqa: F811
    """Upstream's eval_rollout_single_dataset on each set as upstream's EvalDatasetConfig (slime.utils.eval_config,
    resolved from the same YAML): the same samples' settings as eval_rollout gives them."""
    import yaml as yaml_

    from slime.rollout.plugin_rollout import plugin_args
    from slime.rollout.sglang_rollout import GenerateState, eval_rollout_single_dataset
    from slime.utils.async_utils import run
    from slime.utils.eval_config import build_eval_dataset_configs

    args = _eval_setup(tmp_path, tokenizer, engines, eval_min_new_tokens=5)
    args = plugin_args(args, engines[1][0].url, 1, engines[1][:1])
    eval_section = yaml_.safe_load(open(args.eval_config))["eval"]
    configs = build_eval_dataset_configs(args, eval_section["datasets"], eval_section["defaults"])
    GenerateState.clear_instances()
    try:
        data = {}
        for config in configs:
            data |= run(eval_rollout_single_dataset(args, 0, config))
        args.group_rm = True
        with pytest.raises(ValueError, match="--group-rm is not supported"):
            run(eval_rollout_single_dataset(args, 0, configs[0]))
    finally:
        GenerateState.clear_instances()
    _check_sets(data, 5)
