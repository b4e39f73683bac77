"""Upstream slime's fully-async rollout (its examples/fully_async):
`--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async`.

A background worker keeps up to `--sglang-server-concurrency` x engines groups generating (through
`sglang_rollout.generate_and_rm_group`, so `--custom-generate-function-path` / `--custom-rm-path` apply) across
rollout boundaries; each rollout takes the first `--rollout-batch-size` finished groups and leaves the rest queued
for the next one (their samples may come from older weights: that is the point). A group with an ABORTED sample
(the engines were paused for a weight update) goes back to the data source instead of to training. The worker
stops topping up while a full pool of finished groups waits.

The worker's coroutines run on the rollout's one event loop (slime.utils.async_utils), where GenerateState's
semaphore and the HTTP clients live, rather than in a loop of their own. Evaluation is refused, as upstream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any

from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import get_loop, run
from slime.utils.http_utils import get_rollout_num_engines
from slime.utils.types import Sample

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # how often the worker tops up and the rollout looks for finished groups

_worker: list = []  # the process's worker, kept warm across rollouts
_worker_lock = threading.Lock()


class AsyncRolloutWorker:
    """Keeps `concurrency` groups in flight from `data_buffer`; finished groups wait in `completed`."""

    def __init__(self, args: Any, data_buffer: Any, concurrency: int = 10) -> None:
        self.args, self.data_buffer, self.concurrency = args, data_buffer, concurrency
        self.running = True
        self.completed: deque[tuple[int, list[Sample]]] = deque()
        self.active: set[asyncio.Task] = set()
        self.state = GenerateState(args)
        self._next_id = 0
        self._task: asyncio.Future | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.run_coroutine_threadsafe(self._loop(), get_loop())

    def stop(self) -> None:
        self.running = False

    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def queue_size(self) -> int:
        return len(self.completed)

    def get_completed_groups(self, limit: int | None = None) -> list[tuple[int, list[Sample]]]:
        """Up to `limit` finished groups (all when None), oldest first; the rest stay for later."""
        out = []
        while self.completed and (limit is None or len(out) < limit):
            out.append(self.completed.popleft())
        return out

    async def _loop(self) -> None:
        while self.running:
            self._top_up()
            await asyncio.sleep(POLL_SECONDS)
        if self.active:
            await asyncio.wait(self.active, timeout=30)

    def _top_up(self) -> None:
        while len(self.active) < self.concurrency and len(self.completed) < self.concurrency and self.running:
            groups = self.data_buffer.get_samples(1)
            if not groups:
                return
            for group in groups:
                task = asyncio.ensure_future(generate_and_rm_group(
                    self.args, group, sampling_params=self.state.sampling_params.copy(), evaluation=False))
                task.add_done_callback(self._finished(self._next_id))
                self._next_id += 1
                self.active.add(task)

    def _finished(self, group_id: int):
        def done(task: asyncio.Task) -> None:
            self.active.discard(task)
            if task.cancelled():
                return
            if task.exception() is not None:
                logger.error("fully-async: a group's generation failed: %r", task.exception())
                return
            group = task.result()
            if any(s.status == Sample.Status.ABORTED for s in group):
                self.data_buffer.add_samples([group])  # regenerated later, with the new weights
            else:
                self.completed.append((group_id, group))
        return done


def _get_worker(args: Any, data_buffer: Any) -> AsyncRolloutWorker:
    with _worker_lock:
        if not _worker or not _worker[0].is_alive():
            worker = AsyncRolloutWorker(args, data_buffer,
                                        concurrency=args.sglang_server_concurrency * get_rollout_num_engines(args))
            worker.start()
            _worker[:] = [worker]
        return _worker[0]


def stop_worker() -> None:
    with _worker_lock:
        if _worker:
            _worker.pop().stop()


async def _collect(args: Any, rollout_id: int, data_buffer: Any) -> list[list[Sample]]:
    worker = _get_worker(args, data_buffer)
    target = args.rollout_batch_size
    collected: dict[int, list[Sample]] = {}
    while len(collected) < target:
        got = worker.get_completed_groups(limit=target - len(collected))
        collected.update(got)
        if not got:
            await asyncio.sleep(POLL_SECONDS)
    logger.info("fully-async rollout %d: %d groups, %d left queued", rollout_id, target, worker.queue_size())

    def first_index(group: list[Sample]) -> int:
        return next((int(s.index) for s in group if s.index is not None), 0)

    return sorted(collected.values(), key=first_index)


def generate_rollout_fully_async(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False):
    if evaluation:
        raise ValueError("fully-async rollout doesn't support evaluation mode")
    return run(_collect(args, rollout_id, data_buffer))
