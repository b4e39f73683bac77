"""slime.observability.trace_utils against upstream's on the same scripted uses (tests/data/trace_scenarios.py;
recorded by tests/data/record_upstream_trace_utils_cases.py from upstream's module at the commit it names): every
sample trace (events, their order, ids, parents, timestamps of a 1-per-call clock, attributes), exported payloads,
handles and span contexts equal; ids compared after renaming in order of first appearance."""

from __future__ import annotations

import json
import os
import sys

import pytest

import slime.observability.trace_utils as tu
from slime.observability.rollout_metrics import compute_perf_metrics_from_samples
from slime.utils.types import Sample

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from trace_scenarios import run_all  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_trace_utils_cases.json")) as f:
    RECORD = json.load(f)


@pytest.fixture(scope="module")
def ours():
    import time

    try:
        return run_all(tu, Sample)
    finally:
        tu.time = time


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert len(RECORD["scenarios"]) == 7


@pytest.mark.parametrize("name", sorted(RECORD["scenarios"]))
def test_scenario_equals_upstream(ours, name):
    assert ours[name] == RECORD["scenarios"][name]


def test_scenarios_check_something():
    """The recorded outcomes are not trivial: spans nest, errors are recorded, PD children are laid out."""
    s = RECORD["scenarios"]
    events = s["nested_spans"]["trace"]["events"]
    assert [e["type"] for e in events][:3] == ["span_start", "event", "span_start"]
    assert events[2]["parent_span_id"] == events[0]["span_id"] and events[-1]["attrs"]["late"] is True
    assert any(e["name"] == "sglang_pd_decode_forward" for e in events)
    ends = [e for e in s["group_and_errors"]["a"]["events"] if e["type"] == "span_end"]
    assert ends[0]["attrs"] == {"partial": 1, "error_type": "ValueError", "error_message": "bad reward"}
    assert "error_type" not in (ends[1].get("attrs") or {})


def test_a_traced_generate_feeds_the_rollout_timing_metrics():
    """The span a traced generate writes is what the project's perf metrics read (SGLang request timing)."""
    s = Sample(index=0, group_index=0, response_length=2, status=Sample.Status.COMPLETED)
    with tu.trace_span(s, "sglang_generate") as span:
        span.update(tu.build_sglang_meta_trace_attrs({"e2e_latency": 1.5, "queue_time": 0.25,
                                                      "finish_reason": {"type": "stop"}}))
    from types import SimpleNamespace

    metrics = compute_perf_metrics_from_samples(SimpleNamespace(rollout_num_gpus=1), [s], 1.0)
    assert any("e2e_latency" in k and v == 1.5 for k, v in metrics.items()), metrics
