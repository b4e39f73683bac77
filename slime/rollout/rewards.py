"""How the rollout scores samples: the reward named by `--rm-type` or `--custom-rm-path`, through
upstream slime's `slime.rollout.rm_hub` (the graders and their contract live there).

A reward is a number or a dict; a dict is read through `--reward-key` (e.g. `--rm-type dapo --reward-key
score`; `--eval-reward-key` for evaluation, defaulting to `--reward-key`). With `--group-rm` the reward
function is called once per prompt with the list of its samples (`batched_async_rm`).
GRPO-style group normalization belongs to the trainer's advantage computation, not here.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from typing import Any, Callable

from slime.rollout import rm_hub
from slime.rollout.rm_hub.math_utils import grade_answer_verl
from slime.utils.misc import FunctionPathError, load_function

RewardFn = Callable[..., Any]
BUILTIN = rm_hub.BUILTIN


class RewardError(ValueError):
    """Bad reward configuration or value. One line: the problem and the fix."""


def load_custom(path: str, flag: str = "--custom-rm-path") -> Callable:
    """The function named by `package.module.function` (or `package.module:function`)."""
    try:
        fn = load_function(path)
    except FunctionPathError as e:
        raise RewardError(f"{flag}: {e}") from e
    if not callable(fn):
        raise RewardError(f"{flag}: {path!r} is not a function")
    return fn


def math_reward(args: Any, sample: Any) -> int:
    """`--rm-type math` as a plain function (for --custom-rm-path): 1 if the last \\boxed{} equals the label."""
    return 1 if grade_answer_verl(sample.response, sample.label) else 0


def get_reward_fn(args: Any) -> RewardFn:
    """`fn(args, sample)` (a coroutine function for the built-ins): --custom-rm-path, else rm_hub.async_rm."""
    if args.custom_rm_path:
        return load_custom(args.custom_rm_path)
    rm_type = args.rm_type
    if rm_type is None:
        raise RewardError(f"no reward: pass --rm-type ({'/'.join(BUILTIN)}) or --custom-rm-path module.fn")
    base = rm_type[len("boxed_"):] if rm_type.startswith("boxed_") else rm_type
    if base not in BUILTIN:
        raise RewardError(f"--rm-type {rm_type!r} is unknown; choose one of {sorted(BUILTIN)} or use --custom-rm-path")
    return rm_hub.async_rm


def _run(value: Any) -> Any:
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def reward_value(reward: Any, key: str | None, where: str = "reward") -> float:
    """The number a reward stands for: the reward itself, or `reward[key]` for a dict."""
    if isinstance(reward, dict):
        if not key:
            raise RewardError(f"the {where} function returned a dict with keys {sorted(reward)}; pass "
                              f"--reward-key (e.g. --reward-key {next(iter(reward), 'score')}) to say which is the reward")
        if key not in reward:
            raise RewardError(f"--reward-key {key!r} is not in the {where} dict (keys: {sorted(reward)})")
        reward = reward[key]
    if isinstance(reward, numbers.Real):
        return float(reward)
    raise RewardError(f"the {where} function returned {reward!r}; it must return a number or a dict of numbers")


def check_reward(reward: Any, args: Any, sample: Any) -> Any:
    try:
        reward_value(reward, args.reward_key)
    except RewardError as e:
        raise RewardError(f"sample {sample.index}: {e}") from None
    return reward


def compute_reward(fn: RewardFn, args: Any, sample: Any) -> Any:
    """The reward of one sample as the function returned it (number or dict), checked against --reward-key."""
    return check_reward(_run(fn(args, sample)), args, sample)


def compute_rewards(fn: RewardFn, args: Any, samples: list) -> list:
    """`compute_reward` of each sample, with the coroutines of an async reward function awaited together
    in one event loop (one loop per call instead of one per sample: ~0.1 ms each, and concurrent awaits)."""
    values = [fn(args, s) for s in samples]
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:
        async def wait_all() -> list:
            return await asyncio.gather(*(values[i] for i in pending))

        for i, v in zip(pending, asyncio.run(wait_all())):
            values[i] = v
    return [check_reward(v, args, s) for v, s in zip(values, samples)]


def compute_group_rewards(fn: RewardFn, args: Any, samples: list) -> list:
    """--group-rm: one call on a prompt's samples, which returns one reward per sample."""
    rewards = _run(rm_hub.batched_async_rm(args, samples) if fn is rm_hub.async_rm else fn(args, samples))
    rewards = list(rewards)
    if len(rewards) != len(samples):
        raise RewardError(f"the --group-rm reward returned {len(rewards)} rewards for {len(samples)} samples")
    return [check_reward(r, args, s) for r, s in zip(rewards, samples)]
