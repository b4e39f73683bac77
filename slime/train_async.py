"""The one-step-off-policy loop: while the trainer trains on rollout k, the engines (on their own devices)
already generate rollout k+1 with the weights they hold, i.e. those synced after rollout k-1.

    python train_async.py --hf-checkpoint DIR --rollout-num-gpus N --num-rollout M ...

Weights go to the engines after every --update-weights-interval-th trained rollout, once the generation in
flight has finished (an update never lands in the middle of a rollout); the next generation starts after it.
Start-up, cleanup, weight sync, checkpoints, metrics and exits are slime.train's; only the loop differs.
Each metrics record carries the wall-clock bounds of its generation and of its training and the weight
version the engines generated it with, next to the trainer's version it was trained from.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from typing import Any, Sequence

from slime import train as sync

COLOCATE_REFUSED = ("train_async.py: error: --colocate is not supported: the engines generate while the trainer "
                    "trains, so they need devices of their own; pass --rollout-num-gpus N (or use train.py)")


def train(args) -> list[dict[str, Any]]:
    """Run the loop; returns the per-iteration metric records (also in OUTPUT_DIR/metrics.jsonl)."""
    if args.colocate:
        raise ValueError(COLOCATE_REFUSED.split("error: ", 1)[1])
    return sync.train(args, loop=_run)


def _run(args, handles: dict[str, Any], slots) -> list[dict[str, Any]]:
    import ray

    from slime.ray.rollout import create_rollout_manager
    from slime.ray.waiting import get
    from slime.rollout.evaluation import eval_steps
    from slime.utils.metrics import MetricsLogger
    from slime.utils.tracking import Tracker

    actor = handles["actor"]
    start = actor.init("actor", with_ref=args.use_ref_model)
    if args.start_rollout_id is not None:
        start = args.start_rollout_id
    rollout = handles["rollout"] = create_rollout_manager(args, slots["rollout"])
    if start > 0:
        extra = actor.load_extra_state() or {}
        if extra.get("data_source") is not None:
            ray.get(rollout.load_state.remote(extra["data_source"]))
    engines = not args.debug_train_only  # --debug-train-only: no engine to connect to or sync
    if engines:
        sync.logger.info("weight sync mode: %s", actor.connect_rollout_engines(ray.get(rollout.engines.remote())))
        ray.get(rollout.set_weight_source.remote(actor.actors, bool(args.offload_train)))
        # Always: the engines then hold a numbered version, which each record names
        actor.update_weights(start, ray.get(rollout.engines.remote()))
    if args.offload_train:
        actor.offload()

    log = MetricsLogger(args.output_dir, resume_from=start if args.load else None)
    tracker = Tracker(args)
    evals = eval_steps(args, start)
    if 0 in evals:
        sync._evaluate(rollout, log, tracker, 0)
    records: list[dict[str, Any]] = []
    trainer_version = start  # the version the trainer's weights are (rollouts trained so far)
    upcoming: Any = rollout.generate.remote(start)  # a generation in flight, or its result once waited for
    for rollout_id in range(start, args.num_rollout):
        t_iter, driver_cpu = time.perf_counter(), time.thread_time()
        t0 = time.perf_counter()
        result = upcoming if isinstance(upcoming, dict) else sync._wait_with_progress(
            upcoming, rollout, args.rollout_batch_size * args.n_samples_per_prompt)
        waited = time.perf_counter() - t0
        # the data source's position after rollout k, read before k+1 takes its prompts: a resume from this
        # iteration's checkpoint generates rollout k+1 again
        state = ray.get(rollout.state.remote()) if sync._should_save(args, rollout_id) else None
        # The next generation starts now, on the engines' current weights, and runs while this one trains.
        upcoming = rollout.generate.remote(rollout_id + 1) if rollout_id + 1 < args.num_rollout else None
        metrics: dict[str, Any] = {"rollout_id": rollout_id}
        metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))})
        elapsed = metrics["rollout/end_time"] - metrics["rollout/start_time"]
        metrics["time/rollout"] = elapsed
        metrics["time/rollout_wait"] = waited  # how long the trainer waited for it (0 when fully overlapped)
        metrics["perf/rollout_tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(elapsed, 1e-9)
        metrics["train/weight_version"] = float(trainer_version)
        metrics["train/off_policy_versions"] = float(trainer_version - metrics["rollout/weight_version"])
        if args.offload_train:
            actor.onload()

        reuse = sync.reuses_train_log_probs(args, int(result["num_samples"]))
        metrics["train/reused_log_probs"] = float(reuse)
        metrics["train/start_time"] = time.time()
        metrics.update(actor.train_rollout(rollout_id, result["data"], reuse))
        metrics["train/end_time"] = time.time()
        metrics["time/train_call"] = metrics["train/end_time"] - metrics["train/start_time"]
        trainer_version += 1

        metrics["time/weight_sync_call"] = metrics["time/weight_sync"] = 0.0  # replaced when this one syncs
        if engines and (rollout_id + 1) % args.update_weights_interval == 0:
            if upcoming is not None:  # the rollout in flight finishes on the weights it started with
                upcoming = get(upcoming)
            t_call = time.perf_counter()
            metrics.update(sync._sync_weights(actor, rollout, trainer_version, metrics))
            metrics["time/weight_sync_call"] = time.perf_counter() - t_call
            metrics["weight_sync/version"] = float(trainer_version)
        if args.offload_train:
            actor.offload()

        metrics["time/save"] = 0.0
        if state is not None:
            metrics.update(actor.save(rollout_id, {"data_source": state, "rollout_id": rollout_id}))
        sync._close_iteration(metrics, t_iter, driver_cpu, log, tracker, records, args.num_rollout)
        if rollout_id + 1 in evals:  # on the engines' current weights, after the rollout in flight
            if upcoming is not None and not isinstance(upcoming, dict):
                upcoming = get(upcoming)
            sync._evaluate(rollout, log, tracker, rollout_id + 1)
    tracker.close()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """As slime.train.main (same exit statuses, --dry-run included), with the one-step-off-policy loop."""
    from slime.config.arguments import parse_args

    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--colocate" in args_list and "-h" not in args_list and "--help" not in args_list:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                colocate = parse_args(args_list).colocate
        except SystemExit:  # bad input: slime.train's main reports it the usual way
            colocate = False
        if colocate:
            print(COLOCATE_REFUSED, file=sys.stderr, flush=True)
            return 2
    return sync.main(args_list, train_fn=train)


if __name__ == "__main__":
    sys.exit(main())
