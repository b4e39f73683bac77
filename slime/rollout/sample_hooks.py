"""`--rollout-sample-hook-path` (repeatable), upstream slime's per-sample hook:

    def hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None   # or async def

Every generated Sample passes through the hooks in the order given, after generation and before its reward,
on both rollout paths (the built-in loop, slime.rollout.generate, and upstream's, slime.rollout.sglang_rollout),
for training and evaluation alike. A hook returning a Sample replaces the sample with it; None keeps the
(possibly edited in place) sample. A hook gets only the keywords its signature names (all of them with
**kwargs). `rollout_id` is the rollout being generated (or, for evaluation, the rollout the eval follows),
set by the rollout manager with `set_current_rollout_id`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable

from slime.utils.misc import load_function
from slime.utils.types import Sample

_current = {"rollout_id": None}


class SampleHookError(TypeError):
    """A hook returned something other than a Sample or None."""


def set_current_rollout_id(rollout_id: int | None) -> None:
    _current["rollout_id"] = rollout_id


def current_rollout_id() -> int | None:
    return _current["rollout_id"]


def _keywords(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it nothing extra
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


async def _one(args: Any, sample: Sample, paths: list[str], kwargs: dict[str, Any]) -> Sample:
    for path in paths:
        hook = load_function(path)
        out = hook(args, sample, **_keywords(hook, kwargs))
        if inspect.isawaitable(out):
            out = await out
        if out is None:
            continue
        if not isinstance(out, Sample):
            # upstream's words, which plugins' tests match
            raise SampleHookError(f"Rollout sample hook {path!r} returned {type(out).__name__}, expected Sample or None.")
        sample = out
    return sample


async def apply_rollout_sample_hooks(args: Any, value: Any, *, paths: list[str] | None = None,
                                     rollout_id: int | None = None, evaluation: bool = False, **extra: Any) -> Any:
    """The hooks applied to a Sample, or to every Sample of a (nested) list, whose shape is kept.
    paths: default args.rollout_sample_hook_path. Other keywords reach the hooks that name them (as upstream's
    `apply_rollout_sample_hooks(args, value, **kwargs)`)."""
    paths = list(args.rollout_sample_hook_path or []) if paths is None else list(paths)
    if not paths:
        return value
    kwargs = {**extra, "rollout_id": current_rollout_id() if rollout_id is None else rollout_id,
              "evaluation": evaluation}
    return await _apply(args, value, paths, kwargs)


async def _apply(args: Any, value: Any, paths: list[str], kwargs: dict[str, Any]) -> Any:
    if isinstance(value, Sample):
        return await _one(args, value, paths, kwargs)
    if isinstance(value, list):
        return [await _apply(args, item, paths, kwargs) for item in value]
    raise SampleHookError(f"Rollout sample hooks expected Sample or list, got {type(value).__name__}.")


def apply_in_place(args: Any, sample: Sample, evaluation: bool = False) -> None:
    """The built-in loop's call (from its worker threads): the hooks' result copied onto `sample`, the object the
    loop tracks, so a hook that returns a new Sample changes what the rollout returns."""
    if not args.rollout_sample_hook_path:
        return
    out = asyncio.run(apply_rollout_sample_hooks(args, sample, evaluation=evaluation))
    if out is not sample:
        for field in dataclasses.fields(Sample):
            setattr(sample, field.name, getattr(out, field.name))
