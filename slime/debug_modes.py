"""--debug-rollout-only's loop: the engines generate every rollout (and the evaluations), nothing trains.

With --save-debug-rollout-data each rollout's samples are saved (by the rollout manager, as in a full run);
`train.py --load-debug-rollout-data PATH` (which implies --debug-train-only) later trains on them with no engine.
The engines keep --hf-checkpoint's weights throughout: no trainer rank starts, no weight is synced and no
checkpoint is written (upstream's meaning). Records carry the rollout's metrics only.
"""

from __future__ import annotations

import time
from typing import Any


def run_rollout_only(args, handles: dict[str, Any], slots) -> list[dict[str, Any]]:
    from slime import train as loop
    from slime.ray.rollout import create_rollout_manager
    from slime.rollout.evaluation import eval_steps
    from slime.utils.metrics import MetricsLogger
    from slime.utils.tracking import Tracker

    rollout = handles["rollout"] = create_rollout_manager(args, slots["rollout"])
    start = args.start_rollout_id or 0
    log, tracker, records = MetricsLogger(args.output_dir), Tracker(args), []
    evals = eval_steps(args, start)
    if 0 in evals:
        loop._evaluate(rollout, log, tracker, 0)
    for rollout_id in range(start, args.num_rollout):
        t_iter, driver_cpu = time.perf_counter(), time.thread_time()
        t0 = time.perf_counter()
        result = loop._wait_with_progress(rollout.generate.remote(rollout_id), rollout,
                                          args.rollout_batch_size * args.n_samples_per_prompt)
        elapsed = time.perf_counter() - t0
        metrics: dict[str, Any] = {"rollout_id": rollout_id, "time/rollout": elapsed}
        metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))})
        metrics["perf/rollout_tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(elapsed, 1e-9)
        metrics["time/weight_sync"] = metrics["time/save"] = 0.0
        loop._close_iteration(metrics, t_iter, driver_cpu, log, tracker, records, args.num_rollout)
        if rollout_id + 1 in evals:
            loop._evaluate(rollout, log, tracker, rollout_id + 1)
    tracker.close()
    return records
