"""compute_rewards: the rewards of one request's samples, async ones awaited together in one event loop,
equal to compute_reward on each sample and in the samples' order."""

import asyncio
from types import SimpleNamespace

import pytest

from slime.rollout.rewards import RewardError, compute_reward, compute_rewards

ARGS = SimpleNamespace(reward_key=None)
SAMPLES = [SimpleNamespace(index=i, response="x" * i) for i in range(5)]


def test_async_rewards_share_one_loop_and_keep_order():
    loops = []

    async def fn(args, sample):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.001 * (5 - sample.index))  # finish in reverse order
        return float(len(sample.response))

    assert compute_rewards(fn, ARGS, SAMPLES) == [compute_reward(fn, ARGS, s) for s in SAMPLES] == [0, 1, 2, 3, 4]
    assert len({id(loop) for loop in loops[:5]}) == 1  # the batched call: one loop for all five


def test_plain_and_mixed_reward_functions():
    def plain(args, sample):
        return sample.index * 2

    async def coro(args, sample):
        return sample.index

    assert compute_rewards(plain, ARGS, SAMPLES) == [0, 2, 4, 6, 8]
    mixed = lambda args, sample: plain(args, sample) if sample.index % 2 else coro(args, sample)  # noqa: E731
    assert compute_rewards(mixed, ARGS, SAMPLES) == [0, 2, 2, 6, 4]


def test_a_bad_reward_names_its_sample():
    async def bad(args, sample):
        return {"score": 1.0}

    with pytest.raises(RewardError, match="sample 0: .*--reward-key"):
        compute_rewards(bad, ARGS, SAMPLES[:2])
