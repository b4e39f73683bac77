"""Scripted uses of slime.observability.trace_utils, run on upstream's module by record_upstream_trace_utils_cases.py
and on this project's by tests/test_upstream_trace_utils.py: each scenario returns plain data (sample traces,
exported payloads, span contexts' end attributes) with trace/span ids renamed in order of first appearance and a
clock that ticks 1.0 per call (`time.time` in the module under test)."""

from __future__ import annotations

import asyncio
import re

HEX_ID = re.compile(r"^[0-9a-f]{32}$")


class Clock:
    """Stands for the `time` module inside trace_utils: time() = 1000, 1001, ..."""

    def __init__(self):
        self.now = 999.0

    def time(self):
        self.now += 1.0
        return self.now


def normalize(value, names=None):
    names = {} if names is None else names
    if isinstance(value, dict):
        return {k: normalize(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v, names) for v in value]
    if isinstance(value, str) and HEX_ID.match(value):
        return names.setdefault(value, f"id{len(names)}")
    return value


PD_META = {"prompt_tokens": 12, "completion_tokens": 7, "cached_tokens": 3, "queue_time": 0.5, "e2e_latency": 2.0,
           "decode_throughput": None, "id": "req-1", "finish_reason": {"type": "length", "length": 7},
           "pd_prefill_bootstrap_queue_duration": 0.25, "pd_prefill_bootstrap_duration": 0.0,
           "pd_prefill_forward_duration": 0.125, "pd_decode_prealloc_duration": None,
           "pd_decode_transfer_duration": 0.5, "pd_decode_forward_duration": 1.5, "pd_transfer_speed_gb_s": 3.5,
           "pd_prefill_retry_count": 0, "unused": 1}
METAS = [PD_META, {}, {"finish_reason": "stop"}, {"finish_reason": {"message": "no type"}, "id": 7},
         {"pd_decode_forward_duration": 0.25}, {"pd_transfer_total_mb": 5.0, "prompt_tokens": 0},
         {"pd_prefill_forward_duration": "bad", "prompt_tokens": 4}]


def scenarios(tu, Sample):
    """name -> a function of no arguments giving the scenario's plain-data outcome."""

    def nested_spans():
        s = Sample(index=3, group_index=1, prompt="p")
        with tu.trace_span(s, "generate", attrs={"max_new_tokens": 8}) as outer:
            tu.trace_event(s, "tool_call", attrs={"tool": "search"})
            with tu.trace_span(s, "sglang_generate") as inner:
                inner.update(tu.build_sglang_meta_trace_attrs(PD_META))
                inner.set("turn", 0)
            outer.set_attr("turns", 1)
        outer.update_attrs({"late": True})  # after it closed: copied onto its end event
        inner.set("after", 2)
        return {"trace": s.trace, "outer": [outer.end_attrs, outer.closed], "inner": inner.build_end_attrs()}

    def group_and_errors():
        a, b = Sample(index=0, group_index=0), Sample(index=1, group_index=0)
        out = {}
        try:
            with tu.trace_span([a, b], "group_reward_model", attrs={"n": 2}) as span:
                span.set("partial", 1)
                raise ValueError("bad reward")
        except ValueError:
            out["raised"] = True
        try:
            with tu.trace_span(a, "quiet", record_error=False):
                raise KeyError("k")
        except KeyError:
            out["raised_quiet"] = True
        with tu.trace_span([], "nothing") as nothing:
            out["empty_target"] = nothing
        with tu.trace_span(None, "none") as nothing:
            out["none_target"] = nothing
        return {**out, "a": a.trace, "b": b.trace}

    def attempts_and_carriers():
        s = Sample(index=5, group_index=2)
        tu.trace_event(s, "queued")
        handle = tu.trace_next_attempt(s, attrs={"reason": "abort"})
        both = tu.trace_next_attempt([s, Sample(index=6)])
        same = tu.trace_next_attempt("not a target")
        with tu.trace_span(s, "generate"):
            exported = tu.export_trace(handle)
        remote = {}
        imported = tu.import_trace(exported, remote)
        with tu.trace_span(imported, "remote_tool", attrs={"host": "h"}):
            tu.trace_event(imported, "remote_done")
        carrier = tu.bind_trace_carrier(None, sample_id="x", group_id="g", attempt=4)
        kept = tu.bind_trace_carrier({"trace_id": "t0", "attempt": 2, "events": []}, sample_id=9, attempt=7)
        return {"trace": s.trace, "remote": remote, "exported": exported, "handle_attempt": handle.attempt,
                "both": len(both), "same": same, "carrier": [carrier.carrier, carrier.sample_id, carrier.attempt],
                "kept": [kept.carrier, kept.trace_id, kept.attempt],
                "export_outside": tu.export_trace(handle),
                "rebind": [tu.bind_trace(s).attempt, len(s.trace["events"])]}

    def children_layouts():
        s = Sample(index=1)
        with tu.trace_span(s, "custom") as span:
            span.update({tu.TRACE_CHILDREN_KEY: {"type": "span", "name": "one", "start_offset": 0.5,
                                                  "end_offset": 1.0, "attrs": {"k": 1},
                                                  "children": [{"type": "event", "name": "mid", "start_offset": 0.25},
                                                               {"type": "bogus", "name": "x", "start_offset": 0}]}})
            span.update({tu.TRACE_CHILDREN_KEY: [{"type": "span", "name": "backwards", "start_offset": 2.0,
                                                   "end_offset": 1.0}, "junk", {"type": "event", "name": ""},
                                                  {"type": "event", "name": "ev", "start_offset": 3.0,
                                                   "attrs": "not a dict"}], "plain": "v"})
            span.update(None)
            span.update({tu.TRACE_CHILDREN_KEY: [{"type": "span", "name": "no_offset"}]})  # skipped, logged
        return {"trace": s.trace, "end": span.end_attrs}

    def traced_functions():
        calls = []

        @tu.trace_function("generate_and_rm", target="sample", attrs_getter=lambda args, sample, **kw: {"k": 1})
        async def generate_and_rm(args, sample, sampling_params=None):
            calls.append("g")
            await nested(sample)
            return sample

        @tu.trace_function("inner")
        async def nested(sample):
            helper(1)
            return sample

        @tu.trace_function("helper")  # no sample among its arguments: the innermost open span's target
        def helper(x):
            calls.append(x)

        @tu.trace_function("getter", target_getter=lambda pair: pair[1], attrs_getter=lambda pair: ["not", "dict"])
        def with_getter(pair):
            calls.append("getter")

        @tu.trace_function("missing", target="nope")
        def missing(sample):
            calls.append("missing")

        @tu.trace_function("unsupported", target="x")
        def unsupported(x):
            calls.append("unsupported")

        @tu.trace_function("fails", target="sample")
        def fails(sample):
            raise RuntimeError("boom")

        s, t = Sample(index=10, group_index=4), Sample(index=11, group_index=4)
        asyncio.run(generate_and_rm(None, s))
        with_getter((None, t))
        missing(t)
        unsupported(3)
        helper(2)  # nothing open: untraced
        try:
            fails(sample=t)
        except RuntimeError:
            calls.append("raised")
        return {"s": s.trace, "t": t.trace, "calls": calls, "names": [generate_and_rm.__name__, helper.__name__]}

    def boxes_and_lists():
        class SampleBox:
            def __init__(self, prompt_sample, generation):
                self.prompt_sample, self.generation = prompt_sample, generation

        p, g1, g2 = Sample(index=20), Sample(index=21), Sample(index=22)
        tu.trace_event(SampleBox(p, []), "prompt_only")
        tu.trace_event(SampleBox(p, [g1, g2]), "generations")
        tu.trace_event([p, [g1]], "nested_list")
        with tu.trace_span([SampleBox(p, None), g2], "mixed") as span:
            kind = [type(span.target).__name__, len(span.handles)]
        return {"p": p.trace, "g1": g1.trace, "g2": g2.trace, "kind": kind}

    def meta_attrs():
        return [tu.build_sglang_meta_trace_attrs(m) for m in METAS]

    return {f.__name__: f for f in (nested_spans, group_and_errors, attempts_and_carriers, children_layouts,
                                    traced_functions, boxes_and_lists, meta_attrs)}


def run_all(tu, Sample) -> dict:
    out = {}
    for name, fn in scenarios(tu, Sample).items():
        tu.time = Clock()
        value = fn()
        out[name] = normalize(_plain(value))
    return out


def _plain(value):
    """Span contexts and handles as their data (they are returned by some scenarios)."""
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        return {"__type__": type(value).__name__}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
