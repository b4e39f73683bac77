"""Per-sample traces for custom generate / reward functions, at upstream slime's module path with its names and
semantics (upstream 624b824a8, slime/observability/trace_utils.py).

A trace is a plain dict carried by the sample (`sample.trace`, so it travels wherever the sample goes: Ray,
`torch.save` of a debug rollout): `{"version", "trace_id", "events", "sample_id", "group_id", "attempt"}`. Spans
append a `span_start` and a `span_end` event, point events an `event`; each event names its trace, sample, group
and attempt, carries its own `span_id` (spans) and the enclosing span's `parent_span_id`, and `attrs`. A span's
end attributes can still be set after it closes (they are copied onto its end events). SGLang's `meta_info` gives
a request span's attributes and, for PD disaggregation, child spans laid out from the reported durations
(`build_sglang_meta_trace_attrs`). This project's rollout metrics read those spans
(slime.observability.rollout_metrics, SGLang request timing).

Tracing never fails the traced code: a problem in it is logged at debug level and the code runs on untraced.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample

TRACE_VERSION = 1
TRACE_CHILDREN_KEY = "_trace_children"  # an update()'s key for child spans/events laid out under the span
SGLANG_TRACE_META_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "queue_time", "e2e_latency",
                          "decode_throughput")
SGLANG_PD_PREFILL_SEGMENTS = (
    ("pd_prefill_bootstrap_queue_duration", "sglang_pd_prefill_bootstrap_queue"),
    ("pd_prefill_bootstrap_duration", "sglang_pd_prefill_bootstrap"),
    ("pd_prefill_alloc_wait_duration", "sglang_pd_prefill_alloc_wait"),
    ("pd_prefill_forward_duration", "sglang_pd_prefill_forward"),
    ("pd_prefill_transfer_queue_duration", "sglang_pd_prefill_transfer_queue"),
)
SGLANG_PD_DECODE_SEGMENTS = (
    ("pd_decode_prealloc_duration", "sglang_pd_decode_prealloc"),
    ("pd_decode_bootstrap_duration", "sglang_pd_decode_bootstrap"),
    ("pd_decode_alloc_wait_duration", "sglang_pd_decode_alloc_wait"),
    ("pd_decode_transfer_duration", "sglang_pd_decode_transfer"),
    ("pd_decode_forward_duration", "sglang_pd_decode_forward"),
)
SGLANG_PD_SUMMARY_KEYS = ("pd_transfer_speed_gb_s", "pd_transfer_total_mb", "pd_prefill_retry_count")

logger = logging.getLogger(__name__)
# the open spans of this task/thread: (trace_id, span_id) entries, and the handles each open span traces
_OPEN_SPANS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("slime_trace_stack",
                                                                                          default=())
_OPEN_TARGETS: contextvars.ContextVar[tuple[tuple[TraceHandle, ...], ...]] = contextvars.ContextVar(
    "slime_trace_handle_stack", default=())
_WARNED_INFERRED: set[str] = set()

Target = Any  # Sample | TraceHandle | list[Sample | TraceHandle] (or upstream's SampleBox)


@dataclass
class TraceHandle:
    trace_id: str
    carrier: dict[str, Any]
    sample_id: int | str | None = None
    group_id: int | str | None = None
    attempt: int = 0
    parent_span_id: str | None = None


@dataclass
class TraceSpanContext:
    """What `trace_span` yields: end attributes set on it land on the span's end events, also after it closed."""

    target: Target
    handles: list[TraceHandle]
    span_records: list[tuple[TraceHandle, str]] = field(default_factory=list)
    start_ts: float = 0.0
    end_attrs: dict[str, Any] = field(default_factory=dict)
    end_events: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    def set(self, key: str, value: Any) -> TraceSpanContext:
        self.end_attrs[key] = value
        self._copy_to_end_events({key: value})
        return self

    def update(self, attrs: dict[str, Any] | None) -> TraceSpanContext:
        try:
            if attrs:
                plain = dict(attrs)
                children = plain.pop(TRACE_CHILDREN_KEY, None)
                if plain:
                    self.end_attrs.update(plain)
                    self._copy_to_end_events(plain)
                if children:
                    _add_children(self.span_records, children, self.start_ts)
        except Exception as e:
            _skipped("update", e)
        return self

    set_attr = set
    update_attrs = update

    def build_end_attrs(self) -> dict[str, Any] | None:
        return dict(self.end_attrs) or None

    def finalize(self, end_events: list[dict[str, Any]]) -> None:
        self.end_events, self.closed = end_events, True
        if self.end_attrs:
            self._copy_to_end_events(self.end_attrs)

    def _copy_to_end_events(self, attrs: dict[str, Any]) -> None:
        for event in self.end_events if attrs else ():
            event.setdefault("attrs", {}).update(attrs)


def _skipped(action: str, error: Exception) -> None:
    logger.debug("trace %s skipped: %s", action, error, exc_info=True)


def _empty_handle(parent_span_id: str | None = None) -> TraceHandle:
    """The handle of a trace that could not be bound: events go to a carrier nobody keeps."""
    carrier = {"version": TRACE_VERSION, "trace_id": "", "events": [], "sample_id": None, "group_id": None,
               "attempt": 0}
    return TraceHandle("", carrier, parent_span_id=parent_span_id)


# ------------------------------------------------------------------ SGLang's meta_info
def build_sglang_meta_trace_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    """A request span's attributes from SGLang's `meta_info`: token counts and timing, the finish reason's type,
    the request id, and (PD disaggregation) prefill/decode child spans under TRACE_CHILDREN_KEY."""
    attrs: dict[str, Any] = {}
    try:
        attrs.update({k: meta[k] for k in SGLANG_TRACE_META_KEYS if meta.get(k) is not None})
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") is not None:
            attrs["finish_reason"] = reason["type"]
        elif reason is not None:
            attrs["finish_reason"] = reason
        if meta.get("id") is not None:
            attrs["sglang_request_id"] = meta["id"]
        children = _pd_children(meta)
        if children:
            attrs[TRACE_CHILDREN_KEY] = children
    except Exception as e:
        _skipped("sglang_meta_attrs", e)
    return attrs


def _pd_children(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefill phase then the decode phase, each a span over its positive segment durations laid end to
    end (offsets in seconds from the request span's start), then the transfer summary as an event."""
    children, offset = [], 0.0
    for phase, label, segments in (("sglang_pd_prefill", "prefill", SGLANG_PD_PREFILL_SEGMENTS),
                                   ("sglang_pd_decode", "decode", SGLANG_PD_DECODE_SEGMENTS)):
        parts, length = [], 0.0
        for key, name in segments:
            duration = float(meta[key]) if meta.get(key) is not None else 0.0
            if duration > 0.0:
                parts.append({"type": "span", "name": name, "start_offset": length, "end_offset": length + duration,
                              "attrs": {key: meta[key]}})
                length += duration
        if parts:
            children.append({"type": "span", "name": phase, "start_offset": offset, "end_offset": offset + length,
                             "attrs": {"phase": label, "duration_s": length}, "children": parts})
            offset += length
    summary = {k: meta[k] for k in SGLANG_PD_SUMMARY_KEYS if meta.get(k) is not None}
    if summary:
        children.append({"type": "event", "name": "sglang_pd_summary", "start_offset": offset, "attrs": summary})
    return children


# ------------------------------------------------------------------ carriers and handles
def _carrier(carrier: dict[str, Any] | None, trace_id: str | None = None, sample_id: int | str | None = None,
             group_id: int | str | None = None, attempt: int = 0) -> dict[str, Any]:
    """`carrier` (a new dict when None) with every trace key: an existing trace keeps its id, events and attempt;
    sample and group ids given here replace its own."""
    carrier = {} if carrier is None else carrier
    carrier.setdefault("version", TRACE_VERSION)
    carrier.setdefault("trace_id", trace_id or uuid.uuid4().hex)
    carrier.setdefault("events", [])
    for key, value in (("sample_id", sample_id), ("group_id", group_id)):
        if value is not None:
            carrier[key] = value
        else:
            carrier.setdefault(key, None)
    carrier["attempt"] = int(carrier.get("attempt", attempt))
    return carrier


def _handle(carrier: dict[str, Any], parent_span_id: str | None = None) -> TraceHandle:
    return TraceHandle(carrier["trace_id"], carrier, carrier.get("sample_id"), carrier.get("group_id"),
                       int(carrier.get("attempt", 0)), parent_span_id)


def bind_trace(sample: Sample) -> TraceHandle:
    """The sample's trace (`sample.trace`, created on first use), identified by its index and group index."""
    try:
        sample.trace = _carrier(getattr(sample, "trace", None), sample_id=sample.index, group_id=sample.group_index)
        return _handle(sample.trace)
    except Exception as e:
        _skipped("bind", e)
        return _empty_handle()


def bind_trace_carrier(carrier: dict[str, Any] | None, *, trace_id: str | None = None,
                       sample_id: int | str | None = None, group_id: int | str | None = None, attempt: int = 0,
                       parent_span_id: str | None = None) -> TraceHandle:
    """A handle on any dict used as a trace carrier (a new one when None); `parent_span_id` parents its spans."""
    try:
        return _handle(_carrier(carrier, trace_id, sample_id, group_id, attempt), parent_span_id)
    except Exception as e:
        _skipped("bind_carrier", e)
        return _empty_handle(parent_span_id)


def export_trace(handle: TraceHandle) -> dict[str, Any]:
    """What another process needs to continue this trace (`import_trace`): ids, attempt and the current span."""
    try:
        return {"version": TRACE_VERSION, "trace_id": handle.trace_id, "sample_id": handle.sample_id,
                "group_id": handle.group_id, "attempt": handle.attempt,
                "parent_span_id": handle.parent_span_id or _open_span_of(handle.trace_id)}
    except Exception as e:
        _skipped("export", e)
        return {"version": TRACE_VERSION, "trace_id": "", "sample_id": None, "group_id": None, "attempt": 0,
                "parent_span_id": None}


def import_trace(payload: dict[str, Any], carrier: dict[str, Any] | None = None) -> TraceHandle:
    try:
        return bind_trace_carrier(carrier, trace_id=payload.get("trace_id"), sample_id=payload.get("sample_id"),
                                  group_id=payload.get("group_id"), attempt=int(payload.get("attempt", 0)),
                                  parent_span_id=payload.get("parent_span_id"))
    except Exception as e:
        _skipped("import", e)
        return _empty_handle()


def _open_span_of(trace_id: str, stack: tuple[tuple[str, str], ...] | None = None) -> str | None:
    """The innermost open span of `trace_id` in this task/thread."""
    for open_trace, span_id in reversed(_OPEN_SPANS.get() if stack is None else stack):
        if open_trace == trace_id:
            return span_id
    return None


def _record(handle: TraceHandle, kind: str, name: str, ts: float, attrs: dict[str, Any] | None = None,
            span_id: str | None = None, parent_span_id: str | None = None) -> dict[str, Any]:
    event = {"type": kind, "name": name, "ts": ts, "trace_id": handle.trace_id, "sample_id": handle.sample_id,
             "group_id": handle.group_id, "attempt": int(handle.carrier.get("attempt", handle.attempt))}
    for key, value in (("span_id", span_id), ("parent_span_id", parent_span_id)):
        if value is not None:
            event[key] = value
    if attrs:
        event["attrs"] = dict(attrs)
    handle.carrier["events"].append(event)
    return event


def _add_children(parents: list[tuple[TraceHandle, str]], children: Any, parent_start: float) -> None:
    """Child spans/events described by offsets (seconds) from their parent's start, under each parent span."""
    for child in [children] if isinstance(children, dict) else children if isinstance(children, list) else ():
        if not isinstance(child, dict) or child.get("type") not in ("span", "event") or not child.get("name"):
            continue
        name, start = child["name"], parent_start + float(child["start_offset"])
        attrs = child.get("attrs") if isinstance(child.get("attrs"), dict) else None
        if child["type"] == "event":
            for handle, parent in parents:
                _record(handle, "event", name, start, attrs, parent_span_id=parent)
            continue
        end = parent_start + float(child["end_offset"])
        if end < start:
            continue
        spans = []
        for handle, parent in parents:
            spans.append((handle, uuid.uuid4().hex))
            _record(handle, "span_start", name, start, span_id=spans[-1][1], parent_span_id=parent)
        _add_children(spans, child.get("children"), start)
        for handle, span_id in spans:
            _record(handle, "span_end", name, end, attrs, span_id=span_id)


# ------------------------------------------------------------------ events and spans
def trace_event(target: Target, name: str, *, attrs: dict[str, Any] | None = None):
    """A point event on each traced sample/handle, under its innermost open span."""
    try:
        now = time.time()
        for handle in _handles(target):
            _record(handle, "event", name, now, attrs,
                    parent_span_id=handle.parent_span_id or _open_span_of(handle.trace_id))
    except Exception as e:
        _skipped(f"event:{name}", e)


@contextmanager
def trace_span(target: Target, name: str, *, attrs: dict[str, Any] | None = None, record_error: bool = True):
    """A span over the block on each traced sample/handle; yields its TraceSpanContext (the target itself when
    nothing is traced). An exception leaving the block is recorded (`error_type`, `error_message`) and re-raised."""
    try:
        handles = _handles(target)
    except Exception as e:
        _skipped(f"span:{name}", e)
        handles = []
    if not handles:
        yield target
        return
    start, stack, open_targets = time.time(), _OPEN_SPANS.get(), _OPEN_TARGETS.get()
    try:
        records = []
        for handle in handles:
            records.append((handle, uuid.uuid4().hex))
            _record(handle, "span_start", name, start, attrs, span_id=records[-1][1],
                    parent_span_id=handle.parent_span_id or _open_span_of(handle.trace_id, stack))
        stack_token = _OPEN_SPANS.set(stack + tuple((h.trace_id, s) for h, s in records))
        targets_token = _OPEN_TARGETS.set(open_targets + (tuple(handles),))
    except Exception as e:
        _skipped(f"span:{name}", e)
        yield target
        return
    span = TraceSpanContext(handles[0] if len(handles) == 1 else handles, handles, records, start)
    try:
        yield span
    except Exception as error:
        end_attrs = span.build_end_attrs()
        if record_error:
            end_attrs = {**(end_attrs or {}), "error_type": type(error).__name__, "error_message": str(error)}
        _close(span, name, end_attrs)
        raise
    else:
        _close(span, name, span.build_end_attrs())
    finally:
        for var, token in ((_OPEN_SPANS, stack_token), (_OPEN_TARGETS, targets_token)):
            try:
                var.reset(token)
            except Exception as e:  # a generator closed in another context
                _skipped(f"span_reset:{name}", e)


def _close(span: TraceSpanContext, name: str, attrs: dict[str, Any] | None) -> None:
    try:
        now = time.time()
        span.finalize([_record(handle, "span_end", name, now, attrs, span_id=span_id)
                       for handle, span_id in span.span_records])
    except Exception as e:
        _skipped(f"span_end:{name}", e)


def trace_next_attempt(target: Target, *, attrs: dict[str, Any] | None = None):
    """Counts one more attempt on each trace (later events carry it) with an `attempt_start` event; returns the
    handle (or handles) traced."""
    try:
        handles = _handles(target)
        for handle in handles:
            handle.attempt = handle.carrier["attempt"] = int(handle.carrier.get("attempt", 0)) + 1
            trace_event(handle, "attempt_start", attrs={"attempt": handle.attempt, **(attrs or {})})
        if not handles:
            return target
        return handles[0] if len(handles) == 1 else handles
    except Exception as e:
        _skipped("next_attempt", e)
        return target


def trace_function(name: str, *, target: str | None = None,
                   target_getter: Callable[..., Target | None] | None = None,
                   attrs_getter: Callable[..., dict[str, Any] | None] | None = None, record_error: bool = True):
    """A decorator: each call of the (sync or async) function is a span on the trace of its `target` argument
    (by name), of `target_getter(*args, **kwargs)`, else of the first argument that is a Sample / handle / list
    of them, else of the innermost open span's; `attrs_getter(*args, **kwargs)` gives the span's attributes.
    A call with nothing to trace runs untraced."""
    def decorator(fn):
        def span_of(args, kwargs):
            traced = _call_target(fn, args, kwargs, target, target_getter)
            if traced is None:
                return None
            return trace_span(traced, name, attrs=_call_attrs(fn, args, kwargs, attrs_getter),
                              record_error=record_error)

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def traced_async(*args, **kwargs):
                span = span_of(args, kwargs)
                if span is None:
                    return await fn(*args, **kwargs)
                with span:
                    return await fn(*args, **kwargs)
            return traced_async

        @functools.wraps(fn)
        def traced_sync(*args, **kwargs):
            span = span_of(args, kwargs)
            if span is None:
                return fn(*args, **kwargs)
            with span:
                return fn(*args, **kwargs)
        return traced_sync
    return decorator


def _call_target(fn, args: tuple, kwargs: dict, target: str | None, getter: Callable | None) -> Target | None:
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except Exception as e:
        _skipped(f"trace_function_bind:{label}", e)
        bound = None
    if target is not None:
        if bound is None or target not in bound:
            logger.warning("trace_function target '%s' not found for %s; tracing disabled for this call", target,
                           label)
            return None
        found = _traceable(bound[target])
        if found is None:
            logger.warning("trace_function target '%s' for %s is not a supported trace target; tracing disabled "
                           "for this call", target, label)
        return found
    if getter is not None:
        try:
            return _traceable(getter(*args, **kwargs))
        except Exception as e:
            _skipped(f"trace_function_target_getter:{label}", e)
            return None
    for value in bound.values() if bound is not None else args:
        found = _traceable(value)
        if found is not None:
            key = f"{getattr(fn, '__module__', '')}.{label}"
            if key not in _WARNED_INFERRED:
                _WARNED_INFERRED.add(key)
                logger.warning("trace_function auto-inferred target for %s; inference may be ambiguous, prefer "
                               "explicit target=...", label)
            return found
    innermost = _OPEN_TARGETS.get()[-1] if _OPEN_TARGETS.get() else ()
    return None if not innermost else innermost[0] if len(innermost) == 1 else list(innermost)


def _call_attrs(fn, args: tuple, kwargs: dict, getter: Callable | None) -> dict[str, Any] | None:
    if getter is None:
        return None
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        attrs = getter(*args, **kwargs)
    except Exception as e:
        _skipped(f"trace_function_attrs_getter:{label}", e)
        return None
    if attrs is not None and not isinstance(attrs, dict):
        logger.warning("trace_function attrs_getter for %s returned non-dict %s; ignoring attrs", label,
                       type(attrs).__name__)
        return None
    return attrs


# ------------------------------------------------------------------ targets
def _unbox(value: Any) -> Any:
    """Upstream's SampleBox (a prompt sample and its generations) stands for its generations, or its prompt
    sample before it has any; lists are unboxed item by item."""
    if isinstance(value, list):
        return [_unbox(item) for item in value]
    if type(value).__name__ == "SampleBox" and hasattr(value, "prompt_sample") and hasattr(value, "generation"):
        return value.generation or value.prompt_sample
    return value


def _traceable(value: Any) -> Target | None:
    value = _unbox(value)
    if isinstance(value, (Sample, TraceHandle)):
        return value
    if isinstance(value, list) and value and all(_traceable(item) is not None for item in value):
        return value
    return None


def _handles(target: Target) -> list[TraceHandle]:
    target = _unbox(target)
    if isinstance(target, TraceHandle):
        return [target]
    if isinstance(target, Sample):
        return [bind_trace(target)]
    if isinstance(target, list):
        return [handle for item in target for handle in _handles(item)]
    return []
