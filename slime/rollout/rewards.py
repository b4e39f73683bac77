"""Rule-based rewards selected by `--rm-type`, or user code via `--custom-rm-path module.fn`.

A reward function is `fn(args, sample) -> float` (a coroutine function is awaited). Built-ins
(the names upstream slime's scripts use; definitions in slime/rollout/math_grading.py):
  deepscaler DeepScaleR's rule: the text after `</think>` (0 without it), its last \\boxed{...},
             equal to the label after MATH normalization or under sympy; 1 or 0.
  dapo       DAPO's rule: the last "Answer: ..." in the final 300 characters, Minerva-normalized,
             equal to the integer label; 1.0, else -1.0.
  math       the final answer (last \\boxed{...}, else the text after "answer is", else the last
             number) equal to the label after normalization; 1.0 or 0.0.
  f1         token-level F1 of the response against the label.
  random     0 or 1 at random (seeded by --rollout-seed and the sample index): a baseline.
  synthetic  the shaped copy/reverse reward of slime.rollout.synthetic.
A `boxed_` prefix (e.g. `boxed_f1`) grades only the last \\boxed{} of the response.
GRPO-style group normalization belongs to the trainer's advantage computation, not here.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Callable

from slime.rollout import math_grading
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
    return (na is not None and nb is not None and na == nb) or math_grading.math_equal(got, str(label))


def math_reward(args: Any, sample: Sample) -> float:
    return 1.0 if math_answers_match(sample.response, sample.label) else 0.0


def deepscaler_score(response: str, label: Any) -> int:
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return 0  # no finished reasoning: no reward
    answer = math_grading.last_boxed(solution)
    if answer is None or label is None or str(label) == "":
        return 0
    truth = str(label)
    if "\\boxed" in truth:
        truth = math_grading.last_boxed(truth)
        if truth is None:
            return 0
    return int(math_grading.math_equal(answer, truth))


def deepscaler_reward(args: Any, sample: Sample) -> float:
    return float(deepscaler_score(_graded_text(args, sample), sample.label))


def dapo_score(response: str, label: Any) -> float:
    tail = response[-300:]  # DAPO grades the end of the response only
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
    pred = math_grading.minerva_normalize(found[-1]) if found else "[INVALID]"
    truth = math_grading.as_integer_text(math_grading.minerva_normalize(str(label)))
    return 1.0 if truth is not None and pred == truth else -1.0


def dapo_reward(args: Any, sample: Sample) -> float:
    return dapo_score(_graded_text(args, sample), sample.label)


def f1_score(response: str, label: Any) -> float:
    pred, truth = _f1_tokens(response), _f1_tokens(str(label or ""))
    common = sum((Counter(pred) & Counter(truth)).values())
    if not pred or not truth or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def _f1_tokens(text: str) -> list[str]:
    text = re.sub(r"\b(a|an|the)\b", " ", re.sub(r"[^\w\s]", " ", text.lower()))
    return text.split()


def f1_reward(args: Any, sample: Sample) -> float:
    return f1_score(_graded_text(args, sample), sample.label)


def random_reward(args: Any, sample: Sample) -> float:
    return float(random.Random(int(args.rollout_seed) * 1_000_003 + int(sample.index)).randint(0, 1))


def _graded_text(args: Any, sample: Sample) -> str:
    """The response, or only its last \\boxed{} content under a boxed_ --rm-type."""
    if (args.rm_type or "").startswith("boxed_"):
        return math_grading.last_boxed(sample.response or "") or ""
    return sample.response or ""


# ------------------------------------------------------------------ registry
def _synthetic(args: Any, sample: Sample) -> float:
    from slime.rollout.synthetic import synthetic_reward

    return synthetic_reward(args, sample)


BUILTIN: dict[str, RewardFn] = {"deepscaler": deepscaler_reward, "dapo": dapo_reward, "math": math_reward,
                                 "f1": f1_reward, "random": random_reward, "synthetic": _synthetic}


def load_custom(path: str, flag: str = "--custom-rm-path") -> Callable:
    """The function named by `package.module.function` (or `package.module:function`)."""
    mod_name, sep, fn_name = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not fn_name:
        raise RewardError(f"{flag} {path!r} must look like package.module.function")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise RewardError(f"{flag}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RewardError(f"{flag}: {mod_name} has no function {fn_name!r}")
    return fn


def get_reward_fn(args: Any) -> RewardFn:
    custom = args.custom_rm_path
    if custom:
        return load_custom(custom)
    rm_type = args.rm_type
    if rm_type is None:
        raise RewardError(f"no reward: pass --rm-type ({'/'.join(BUILTIN)}) or --custom-rm-path module.fn")
    base = rm_type[len("boxed_"):] if rm_type.startswith("boxed_") else rm_type
    if base not in BUILTIN:
        raise RewardError(f"--rm-type {rm_type!r} is unknown; choose one of {sorted(BUILTIN)} or use --custom-rm-path")
    return BUILTIN[base]


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
