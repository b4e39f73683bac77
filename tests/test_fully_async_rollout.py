"""slime.rollout.fully_async_rollout (upstream's examples/fully_async rollout function): groups keep generating
across rollouts, each rollout takes --rollout-batch-size finished groups ordered by sample index, aborted groups
go back to the data source, evaluation is refused. generate_and_rm_group is replaced by a stand-in here; the
whole path through train.py is tests/test_fully_async_run.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from slime.rollout import fully_async_rollout as fa
from slime.utils.types import Sample


class Buffer:
    def __init__(self, n_groups):
        self.groups = [[Sample(index=2 * g + i, group_index=g) for i in range(2)] for g in range(n_groups)]
        self.returned = []

    def get_samples(self, n):
        out, self.groups = self.groups[:n], self.groups[n:]
        return out

    def add_samples(self, groups):
        self.returned += groups
        self.groups += groups


@pytest.fixture
def worker_env(monkeypatch):
    calls = []

    async def fake_group(args, group, sampling_params, evaluation=False):
        calls.append(group[0].group_index)
        await asyncio.sleep(0.01 * (3 - group[0].group_index % 3))  # finish out of order
        aborted = group[0].group_index == 1 and calls.count(1) == 1  # group 1 aborts the first time
        for s in group:
            s.status = Sample.Status.ABORTED if aborted else Sample.Status.COMPLETED
        return group

    monkeypatch.setattr(fa, "generate_and_rm_group", fake_group)
    monkeypatch.setattr(fa, "GenerateState", lambda args: SimpleNamespace(sampling_params={"temperature": 1.0}))
    monkeypatch.setattr(fa, "get_rollout_num_engines", lambda args: 1)
    yield calls
    fa.stop_worker()


def test_rollouts_take_finished_groups_and_keep_the_rest(worker_env):
    args = SimpleNamespace(rollout_batch_size=2, sglang_server_concurrency=3)
    buffer = Buffer(8)
    first = fa.generate_rollout_fully_async(args, 0, buffer)
    assert len(first) == 2 and all(s.status == Sample.Status.COMPLETED for g in first for s in g)
    assert [g[0].index for g in first] == sorted(g[0].index for g in first)
    second = fa.generate_rollout_fully_async(args, 1, buffer)
    seen = {g[0].group_index for g in first + second}
    assert len(seen) == 4 and len(fa._worker[0].active) + fa._worker[0].queue_size() > 0  # the pool stays warm
    assert [g[0].group_index for g in buffer.returned] == [1]  # the aborted group went back, once
    third = fa.generate_rollout_fully_async(args, 2, buffer)
    assert not seen & {g[0].group_index for g in third}


def test_evaluation_refused():
    with pytest.raises(ValueError, match="evaluation mode"):
        fa.generate_rollout_fully_async(SimpleNamespace(), 0, None, evaluation=True)
