"""--eval-config (upstream's YAML of eval sets with their own settings) and --eval-min-new-tokens: resolution equal to
upstream's recorded one, every upstream key honored or refused in one line, and the settings reaching the engine on
both evaluation paths (the built-in evaluate and upstream's sglang_rollout.eval_rollout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slime.config.eval_config import HONORED_KEYS, REFUSED_KEYS
from slime.config.rollout_args import RolloutArgumentError, rollout_defaults, validate_rollout_args
from tests.test_rollout import _Fleet, _rollout_setup, engines, tokenizer  # noqa: F401 (fixtures)

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


def _eval_setup(tmp_path, tokenizer, engines, **config_flags):
    args, _ = _rollout_setup(tmp_path, tokenizer)
    small = tmp_path / "eval.jsonl"
    small.write_text("".join(open(args.prompt_data).readlines()[:3]))
    args.hf_checkpoint = engines[0]
    args.rollout_stop_token_ids = STOP_ALMOST_ALL
    config = {"eval": {"defaults": {"max_response_len": 6}, "datasets": [
        {"name": "bonus", "path": str(small), "n_samples_per_eval_prompt": 2, "max_response_len": 3,
         "min_new_tokens": 0,
         "custom_rm_path": "tests.test_eval_config:length_plus_bonus", "metadata_overrides": {"bonus": 100}},
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
def test_builtin_evaluate_uses_each_sets_settings(engines, tmp_path, tokenizer, min_flag):
    from slime.rollout.evaluation import evaluate, load_eval_sets
    from slime.rollout.rewards import get_reward_fn

    args = _eval_setup(tmp_path, tokenizer, engines, eval_min_new_tokens=min_flag)
    data: dict = {}
    metrics = evaluate(args, _Fleet(engines[1]), load_eval_sets(args, tokenizer), tokenizer, get_reward_fn(args), data)
    _check_sets(data, min_flag)
    assert metrics["eval/bonus/samples"] == 6.0


def test_plugin_eval_rollout_uses_each_sets_settings(engines, tmp_path, tokenizer):
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
