"""The one generation loop: prompt groups streamed through a group generator, the first --rollout-batch-size
to finish that the dynamic-sampling filter keeps (upstream slime's rollout loop).

    data, every = await stream_groups(args, generator, source, target, batch, dynamic_filter, gatherer)

While fewer than `target` groups are submitted and not dropped, `source(batch)` gives `batch` more groups
(--over-sampling-batch-size), which go to `generator.submit_generate_tasks`; each finished group is offered to
the filter, kept (up to `target`) or dropped and counted. The loop ends when `target` groups are kept; the
groups still pending are the caller's to abort (their generator's own abort).

A generator holds `pendings` (awaitables, each giving one finished group), `remaining_batch_size` (groups
submitted and not dropped) and `submit_generate_tasks(groups)`. Two serve it:
- upstream's `GenerateState` (slime.rollout.sglang_rollout): a task per group, `generate_and_rm_group` posting
  each sample to the router address, which the rollout manager points at its fleet proxy
  (slime.rollout.fleet_proxy);
- the built-in `FleetGroups` (slime.rollout.generate): each submission's samples sent as batched /generate
  requests over the engine fleet, a group finishing when its last sample is generated and scored.
Both re-send a request lost to a dead engine once the fleet has restarted it (`generate.lose_request`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output


async def stream_groups(args: Any, generator: Any, source: Callable[[int], list], target: int, batch: int,
                        dynamic_filter: Callable | None, gatherer: MetricGatherer) -> tuple[list, list]:
    """(kept groups, every finished group), each in finishing order; see the module docstring."""
    data: list = []
    every: list = []
    while len(data) < target:
        while generator.remaining_batch_size < target:
            generator.submit_generate_tasks(source(batch))
        done, generator.pendings = await asyncio.wait(generator.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            every.append(group)
            verdict = call_dynamic_filter(dynamic_filter, args, group)
            if should_drop_dynamic_filter_output(verdict, remaining_batch_size=generator.remaining_batch_size,
                                                 target_data_size=target):
                gatherer.on_dynamic_filter_drop(verdict.reason)
                generator.remaining_batch_size -= 1
                continue
            if len(data) < target:
                data.append(group)
    return data, every


def first_sample(group: list) -> Any:
    """A group's first sample (a group item may be a list of samples: a multi-sample generate function's)."""
    return group[0][0] if isinstance(group[0], list) else group[0]


def sort_groups(groups: list) -> None:
    """In prompt order (the order of their first samples' indices), as the trainer and the logs see them."""
    groups.sort(key=lambda g: first_sample(g).index)
