"""train_async.py's loop, one step off policy: while the trainer trains on rollout k, the engines (on their own
devices) already generate rollout k+1 with the weights they hold, i.e. those synced after rollout k-1.

Weights go to the engines after every --update-weights-interval-th trained rollout, once the generation in
flight has finished (an update never lands in the middle of a rollout); the next generation starts after it.
Each record carries the wall-clock bounds of its generation and of its training and the weight version the
engines generated it with, next to the trainer's version it was trained from.
"""

from __future__ import annotations

import time
from typing import Any

from slime.run.session import RunSession


def run(session: RunSession) -> list[dict[str, Any]]:
    from slime.ray.waiting import get

    args = session.args
    start = session.start_trainer()
    session.start_rollout()
    if session.engines:  # --debug-train-only: no engine to connect to or sync
        session.connect_engines()
        session.push_weights(start)  # always: the engines then hold a numbered version, which each record names
    if args.offload_train:
        session.actor.offload()
    session.open_metrics()
    trainer_version = start  # the version the trainer's weights are (rollouts trained so far)
    upcoming: Any = session.rollout.generate.remote(start)  # a generation in flight, or its result once waited for
    for rollout_id in session.rollout_ids():
        metrics = session.begin_iteration(rollout_id)
        t0 = time.perf_counter()
        result = upcoming if isinstance(upcoming, dict) else session.wait_for_rollout(upcoming)
        waited = time.perf_counter() - t0
        # the data source's position after rollout k, read before k+1 takes its prompts: a resume from this
        # iteration's checkpoint generates rollout k+1 again
        save_point = session.save_point(rollout_id)
        # The next generation starts now, on the engines' current weights, and runs while this one trains.
        upcoming = session.rollout.generate.remote(rollout_id + 1) if rollout_id + 1 < args.num_rollout else None
        generated = result.get("metrics", {})
        session.add_rollout_metrics(metrics, result, generated["rollout/end_time"] - generated["rollout/start_time"])
        metrics["time/rollout_wait"] = waited  # how long the trainer waited for it (0 when fully overlapped)
        metrics["train/weight_version"] = float(trainer_version)
        metrics["train/off_policy_versions"] = float(trainer_version - metrics["rollout/weight_version"])
        session.train(rollout_id, result, metrics, wall_clock=True)
        trainer_version += 1
        metrics["time/weight_sync_call"] = metrics["time/weight_sync"] = 0.0  # replaced when this one syncs
        if session.engines and (rollout_id + 1) % args.update_weights_interval == 0:
            if upcoming is not None:  # the rollout in flight finishes on the weights it started with
                upcoming = get(upcoming)
            t_call = time.perf_counter()
            session.sync_weights(trainer_version, metrics)
            metrics["time/weight_sync_call"] = time.perf_counter() - t_call
            metrics["weight_sync/version"] = float(trainer_version)
        if args.offload_train:
            session.actor.offload()
        session.save(save_point, metrics)
        session.close_iteration(metrics)
        if rollout_id + 1 in session.evals and upcoming is not None and not isinstance(upcoming, dict):
            upcoming = get(upcoming)  # evaluated on the engines' current weights, after the rollout in flight
        session.evaluate_if_due(rollout_id + 1)
    return session.finish()
