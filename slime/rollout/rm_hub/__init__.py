"""Rewards by name (`--rm-type`) or by path (`--custom-rm-path`), upstream slime's `rm_hub` contract.

    reward = await async_rm(args, sample)            # one sample
    rewards = await batched_async_rm(args, samples)  # a list (with --custom-rm-path: one call on the list)

Built-in `--rm-type`s (a sample's `metadata["rm_type"]` overrides the flag; a `boxed_` prefix grades only
the response's last `\\boxed{}`):
  deepscaler  1/0, DeepScaleR's rule (deepscaler.py)       math     1/0, grade_answer_verl (math_utils.py)
  dapo        {"score": 1.0/-1.0, "acc", "pred"}; read it with --reward-key score (math_dapo_utils.py)
  f1          token F1 (f1.py)                             gpqa     1.0/0.0 multiple choice (gpqa.py)
  remote_rm   POST {prompt, response, label} to --rm-url (through --http-proxy when given); its JSON answer
              is the reward
  random      0 or 1 (seeded by --rollout-seed and the sample index)
  synthetic   this project's shaped copy/reverse reward (slime.rollout.synthetic)
A custom reward is `async def fn(args, sample, **kwargs)` (a plain function is accepted too) returning a
number or a dict; with `--group-rm` it gets the list of a prompt's samples and returns a list.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from typing import Any

from slime.utils.misc import load_function

from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer as extract_boxed_answer
from .math_utils import grade_answer_verl

logger = logging.getLogger(__name__)

RULE_BASED = ("deepscaler", "dapo", "math", "f1", "gpqa", "random", "synthetic")
BUILTIN = RULE_BASED + ("remote_rm",)
REMOTE_RM_RETRIES = 10


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def remote_rm(args: Any, sample: Any, max_retries: int = REMOTE_RM_RETRIES) -> Any:
    """POST {"prompt", "response", "label"} to --rm-url; retried once a second, `max_retries` attempts (http_utils.post)."""
    from slime.utils import http_utils

    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await http_utils.post(args.rm_url, payload, max_retries=max_retries,
                                 proxy=getattr(args, "http_proxy", None))  # --http-proxy


def _rule_based(args: Any, rm_type: str, response: str, sample: Any, metadata: dict) -> Any:
    label = sample.label
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "dapo":
        return compute_score_dapo(response, label)
    if rm_type == "math":
        return 1 if grade_answer_verl(response, label) else 0
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, metadata=metadata)
    if rm_type == "random":
        seed = int(getattr(args, "rollout_seed", 0) or 0) * 1_000_003 + int(getattr(sample, "index", 0) or 0)
        return random.Random(seed).randint(0, 1)
    if rm_type == "synthetic":
        from slime.rollout.synthetic import synthetic_reward

        return synthetic_reward(args, sample)
    if rm_type == "ifbench":
        raise NotImplementedError("--rm-type ifbench needs AllenAI's IFBench checkers, which this project does "
                                  "not ship; use --custom-rm-path with your own wrapper of them")
    if rm_type:
        raise NotImplementedError(f"--rm-type {rm_type!r} is not a built-in reward ({', '.join(BUILTIN)}); "
                                  "use --custom-rm-path module.fn")
    raise NotImplementedError("no reward: pass --rm-type or --custom-rm-path")


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The reward of one sample: its own `custom_rm_path` (eval datasets), else --custom-rm-path, else the
    rule named by its `metadata["rm_type"]` or --rm-type."""
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await _maybe_await(load_function(path)(args, sample, **kwargs))
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    response = sample.response
    if rm_type.startswith("boxed_"):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type[len("boxed_"):]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    return _rule_based(args, rm_type, response, sample, metadata)


async def batched_async_rm(args: Any, samples: list, **kwargs: Any) -> list:
    """Rewards of several samples: one call of --custom-rm-path on the whole list (it must take a list),
    else async_rm on each, concurrently."""
    if getattr(args, "custom_rm_path", None):
        return list(await _maybe_await(load_function(args.custom_rm_path)(args, samples, **kwargs)))
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
