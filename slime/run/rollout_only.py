"""--debug-rollout-only's loop: the engines generate every rollout (and the evaluations), nothing trains.

With --save-debug-rollout-data each rollout's samples are saved (by the rollout manager, as in a full run);
`train.py --load-debug-rollout-data PATH` (which implies --debug-train-only) later trains on them with no engine:
that is the synchronous loop (slime.run.synchronous) with no engine to connect to or sync.
The engines keep --hf-checkpoint's weights throughout: no trainer rank starts, no weight is synced and no
checkpoint is written (upstream's meaning). Records carry the rollout's metrics only.
"""

from __future__ import annotations

from typing import Any

from slime.run.session import RunSession


def run(session: RunSession) -> list[dict[str, Any]]:
    session.start_rollout()
    session.start = session.args.start_rollout_id or 0
    session.open_metrics(resume=False)
    for rollout_id in session.rollout_ids():
        metrics = session.begin_iteration(rollout_id)
        result, elapsed = session.generate(rollout_id)
        session.add_rollout_metrics(metrics, result, elapsed)
        metrics["time/weight_sync"] = metrics["time/save"] = 0.0
        session.close_iteration(metrics)
        session.evaluate_if_due(rollout_id + 1)
    return session.finish()
