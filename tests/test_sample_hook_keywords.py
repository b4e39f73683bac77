"""apply_rollout_sample_hooks as upstream's: each hook gets only the keywords its signature names (all of
them with **kwargs), extra keywords of the caller included; upstream's words for a bad return value or input."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.utils.types import Sample

SEEN: list = []


def positional_only(args, sample):
    SEEN.append(("positional_only",))


def names_rollout_id(args, sample, rollout_id):
    SEEN.append(("names_rollout_id", rollout_id))


async def takes_everything(args, sample, **kwargs):
    SEEN.append(("takes_everything", dict(kwargs)))
    return Sample(index=sample.index + 100)


def names_extra(args, sample, *, tag=None):
    SEEN.append(("names_extra", tag, sample.index))


def test_each_hook_gets_only_its_keywords():
    SEEN.clear()
    args = SimpleNamespace(rollout_sample_hook_path=[f"{__name__}.{n}" for n in
                                                     ("positional_only", "names_rollout_id", "takes_everything",
                                                      "names_extra")])
    out = asyncio.run(apply_rollout_sample_hooks(args, Sample(index=1), rollout_id=7, evaluation=True, tag="x"))
    assert out.index == 101
    assert SEEN == [("positional_only",), ("names_rollout_id", 7),
                    ("takes_everything", {"tag": "x", "rollout_id": 7, "evaluation": True}), ("names_extra", "x", 101)]


def test_bad_value_is_upstreams_error():
    args = SimpleNamespace(rollout_sample_hook_path=[f"{__name__}.positional_only"])
    with pytest.raises(TypeError, match=r"^Rollout sample hooks expected Sample or list, got dict\.$"):
        asyncio.run(apply_rollout_sample_hooks(args, {"index": 0}))
