"""Rule-based rewards selected by `--rm-type`, or user code via `--custom-rm-path module.fn`.

A reward function is `fn(args, sample) -> float` (a coroutine function is awaited). Built-ins:
  math       exact match of the final answer (last \\boxed{...}, else the text after "answer is",
             else the last number) with the label, after normalization; 1.0 or 0.0.
  synthetic  the shaped copy/reverse reward of slime.rollout.synthetic.
GRPO-style group normalization belongs to the trainer's advantage computation, not here.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from fractions import Fraction
from typing import Any, Callable

from slime.rollout.sample import Sample

RewardFn = Callable[[Any, Sample], float]


class RewardError(ValueError):
    """Bad reward configuration. One line: the problem and the fix."""


# ------------------------------------------------------------------ math exact match
def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    m = re.search(r"answer is[:\s]*([^\n]+)", text, flags=re.IGNORECASE)
    if m:
        return m.group(1).strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalize_answer(ans: Any) -> str:
    s = str(ans).strip()
    for pat in (r"^\$+|\$+$", r"\\text\{([^}]*)\}", r"\\left|\\right", r"\\!|\\,|\\ "):
        s = re.sub(pat, lambda m: m.group(1) if m.groups() else "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.lower()


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_match(response: str, label: Any) -> bool:
    got = extract_answer(response)
    if got is None or label is None:
        return False
    a, b = normalize_answer(got), normalize_answer(label)
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    return na is not None and nb is not None and na == nb


def math_reward(args: Any, sample: Sample) -> float:
    return 1.0 if math_answers_match(sample.response, sample.label) else 0.0


# ------------------------------------------------------------------ registry
def _synthetic(args: Any, sample: Sample) -> float:
    from slime.rollout.synthetic import synthetic_reward

    return synthetic_reward(args, sample)


BUILTIN: dict[str, RewardFn] = {"math": math_reward, "synthetic": _synthetic}


def load_custom(path: str) -> RewardFn:
    mod_name, sep, fn_name = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not fn_name:
        raise RewardError(f"--custom-rm-path {path!r} must look like package.module.function")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise RewardError(f"--custom-rm-path: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RewardError(f"--custom-rm-path: {mod_name} has no function {fn_name!r}")
    return fn


def get_reward_fn(args: Any) -> RewardFn:
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        return load_custom(custom)
    rm_type = getattr(args, "rm_type", None)
    if rm_type is None:
        raise RewardError(f"no reward: pass --rm-type ({'/'.join(BUILTIN)}) or --custom-rm-path module.fn")
    if rm_type not in BUILTIN:
        raise RewardError(f"--rm-type {rm_type!r} is unknown; choose one of {sorted(BUILTIN)} or use --custom-rm-path")
    return BUILTIN[rm_type]


def compute_reward(fn: RewardFn, args: Any, sample: Sample) -> float:
    value = fn(args, sample)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function returned {value!r} for sample {sample.index}; it must return a number") from e


async def _await(x: Any) -> Any:
    return await x
