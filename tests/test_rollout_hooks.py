"""--rollout-sample-hook-path on both rollout paths (the built-in loop and upstream's sglang_rollout), in
training and evaluation: hooks run in order on every generated sample, before its reward, with the keywords
their signatures name."""

from __future__ import annotations

import copy

import pytest

from slime.rollout.generate import generate_rollout
from slime.rollout.rewards import get_reward_fn
from slime.rollout.sample_hooks import SampleHookError, apply_rollout_sample_hooks, set_current_rollout_id
from slime.utils.types import Sample
from tests.test_rollout import _Fleet, _rollout_setup, engines, tokenizer  # noqa: F401 (fixtures)

HOOKS = ["tests.test_rollout_hooks:answer_with_label", "tests.test_rollout_hooks:record_call"]


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


def _setup(tmp_path, tokenizer):
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.rm_type, args.custom_rm_path = None, "tests.test_rollout_hooks:exact"
    args.rollout_batch_size, args.n_samples_per_prompt = 2, 2
    return args, ds


def _check(samples, rollout_id, evaluation):
    assert samples
    for s in samples:
        assert s.metadata["reward_when_hooked"] is None  # hooks run before the reward
        assert s.response == s.label and s.reward == 1.0
        assert s.metadata["calls"] == [(rollout_id, evaluation, True)]


def test_builtin_rollout_applies_hooks_before_the_reward(engines, tmp_path, tokenizer):
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


def test_builtin_evaluation_applies_hooks_with_evaluation_true(engines, tmp_path, tokenizer):
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


def test_plugin_rollout_applies_hooks_before_the_reward(engines, tmp_path, tokenizer):
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

    args = SimpleNamespace(rollout_sample_hook_path=["tests.test_rollout_hooks:not_a_sample"])
    with pytest.raises(SampleHookError, match="not_a_sample returned dict"):
        asyncio.run(apply_rollout_sample_hooks(args, Sample(index=0)))
    args.rollout_sample_hook_path = ["tests.test_rollout_hooks:record_call"]
    nested = [Sample(index=0), [Sample(index=1), Sample(index=2)]]
    out = asyncio.run(apply_rollout_sample_hooks(args, nested, rollout_id=4, evaluation=True))
    assert [type(x).__name__ for x in out] == ["Sample", "list"] and len(out[1]) == 2
    assert out[1][1].index == 2 and out[1][1].metadata["calls"] == [(4, True, False)]


def test_flag_is_repeatable_and_checked():
    from slime.config.rollout_args import RolloutArgumentError, rollout_defaults, validate_rollout_args
    from slime.config.arguments import build_parser

    ns = build_parser().parse_args(["--rollout-sample-hook-path", HOOKS[0], "--rollout-sample-hook-path", HOOKS[1]])
    assert ns.rollout_sample_hook_path == HOOKS
    with pytest.raises(RolloutArgumentError, match="--rollout-sample-hook-path"):
        validate_rollout_args(rollout_defaults(rollout_sample_hook_path=["tests.test_rollout_hooks:missing"]))
