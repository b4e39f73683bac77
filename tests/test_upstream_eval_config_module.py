"""slime.utils.eval_config against upstream's on the same inputs (tests/data/upstream_eval_config_cases.json,
recorded by tests/data/record_upstream_eval_config_cases.py from upstream's file at the commit it names), and its
EvalDatasetConfig carried into the project's EvalDataset with the settings slime.rollout.eval_datasets resolves
for upstream's recorded --eval-config (tests/data/upstream_eval_config.json)."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from slime.utils import eval_config as ec

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "upstream_eval_config_cases.json")) as f:
    RECORD = json.load(f)
with open(os.path.join(DATA, "upstream_eval_config.json")) as f:
    RESOLUTION = json.load(f)


def cases(fn):
    return [c for c in RECORD["cases"] if c["fn"] == fn]


def run(fn):
    try:
        return {"ok": fn()}
    except (ValueError, TypeError) as e:
        return {"error": type(e).__name__}


def test_fields_are_upstreams():
    assert [f.name for f in dataclasses.fields(ec.EvalDatasetConfig)] == RECORD["fields"]


@pytest.mark.parametrize("case", cases("ensure_dataset_list"), ids=lambda c: json.dumps(c["input"]))
def test_ensure_dataset_list_matches_upstream(case):
    config = tuple(case["input"]) if case["tuple"] else case["input"]
    assert run(lambda: ec.ensure_dataset_list(config)) == case["out"]


@pytest.mark.parametrize("case", cases("pick_from_args"), ids=lambda c: f"{c['args']}-{c['attrs']}")
def test_pick_from_args_matches_upstream(case):
    assert ec.pick_from_args(SimpleNamespace(**case["args"]), tuple(case["attrs"])) == case["out"]


@pytest.mark.parametrize("case", cases("build_eval_dataset_configs"),
                         ids=lambda c: json.dumps([c["entries"], c["defaults"]]))
def test_build_eval_dataset_configs_matches_upstream(case):
    def build():
        built = ec.build_eval_dataset_configs(SimpleNamespace(**RECORD["flags"]), case["entries"], case["defaults"])
        return [{"fields": dataclasses.asdict(d), "cache_key": list(d.cache_key),
                 "metadata": [d.inject_metadata({"orig": 1, "rm_type": "old"}), d.inject_metadata("not a dict")]}
                for d in built]
    assert run(build) == case["out"]


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="bogus"):
        ec.build_eval_dataset_configs(SimpleNamespace(), [{"name": "a", "path": "a"}], {"bogus": 1})
    with pytest.raises(ValueError, match="min_eval_samples"):
        ec.EvalDatasetConfig("a", "a", min_eval_samples=0)
    with pytest.raises(ValueError, match="name"):
        ec.ensure_dataset_list([{"path": "p"}])


def test_to_eval_dataset_resolves_as_the_project_does():
    """Upstream's recorded resolution of its --eval-config, through EvalDatasetConfig.to_eval_dataset, equals
    what slime.rollout.eval_datasets resolves from the same args and config (settings set on both sides)."""
    from slime.rollout.eval_datasets import SETTINGS, resolve_eval_dataset

    args = SimpleNamespace(**RESOLUTION["args"])
    raw = RESOLUTION["config"]["eval"]
    built = ec.build_eval_dataset_configs(args, ec.ensure_dataset_list(raw["datasets"]), raw["defaults"])
    assert [dataclasses.asdict(d) for d in built] == RESOLUTION["resolved"]
    assert [d.inject_metadata({"orig": 1}) for d in built] == RESOLUTION["metadata"]
    for config, entry in zip(built, raw["datasets"]):
        ours = resolve_eval_dataset(args, entry, raw["defaults"])
        assert config.to_eval_dataset() == ours
        assert all(getattr(ours, key) == getattr(config, key) for key in SETTINGS if getattr(config, key) is not None)
