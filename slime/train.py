"""The RL loop: rollout -> rewards -> old/ref log-probs -> advantages -> train -> weight sync -> save.

    python train.py --hf-checkpoint DIR --num-rollout N ...     (also: python -m slime.train)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, Sequence

logger = logging.getLogger("slime.train")


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("SLIME_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def reuses_train_log_probs(args, num_samples: int) -> bool:
    """Whether the first training forward's detached log-probs can serve as the old log-probs, saving the
    separate old-policy forward: exactly one optimizer step per rollout (so that forward runs on the weights
    that generated the rollout, like the old-policy forward would), nothing needs them before training (no
    KL-shaped reward), the engine's log-probs do not replace them (--use-rollout-logprobs) and no dropout."""
    from slime.backends.megatron.data import step_indices

    kl_in_reward = (args.advantage_estimator.startswith("reinforce_plus_plus") or args.advantage_estimator == "ppo") \
        and args.kl_coef > 0
    if args.use_opd or args.use_rollout_entropy:  # the OPD term / the hooks read them (and the entropy) before training
        return False
    one_step = len(step_indices(num_samples, args.global_batch_size)) == 1
    # with --hidden-dropout the training forward is stochastic; old log-probs need the deterministic one
    # --keep-old-actor: the old log-probs come from the kept copy, not from the weights being trained
    return (one_step and not kl_in_reward and not args.use_rollout_logprobs and args.hidden_dropout == 0
            and not args.keep_old_actor)


def _wait_with_progress(ref, rollout, total: int, after_s: float = 2.0):
    """ray.get(ref) without waking while it waits (slime.ray.waiting), drawing a one-line progress bar on
    an interactive terminal when it takes a while."""
    from slime.ray.waiting import get, wait_ready

    if not sys.stderr.isatty() or not total:
        return get(ref)
    start, drawn = time.perf_counter(), False
    while not wait_ready([ref], timeout=0.5):
        if time.perf_counter() - start < after_s:
            continue
        try:
            done = int(get(rollout.progress.remote(), timeout=1.0).get("done", 0))
        except Exception:
            break
        filled = int(30 * min(done, total) / total)
        sys.stderr.write(f"\r  rollout [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} samples "
                         f"{time.perf_counter() - start:.0f}s")
        sys.stderr.flush()
        drawn = True
    if drawn:
        sys.stderr.write("\r" + " " * 72 + "\r")
    return get(ref)


def _should_save(args, rollout_id: int) -> bool:
    if not args.save:
        return False
    last = rollout_id == args.num_rollout - 1
    return last or (args.save_interval is not None and (rollout_id + 1) % args.save_interval == 0)


def train(args, loop=None) -> list[dict[str, Any]]:
    """Run the loop (`loop(args, handles, slots)`, default the synchronous one; slime.train_async passes its
    own); returns the per-iteration metric records (also in OUTPUT_DIR/metrics.jsonl)."""
    from slime.ray.actor_group import RayTrainGroup
    from slime.ray.placement_group import create_placement_groups, init_ray

    from slime.utils.exits import library_signal_handlers_reclaimed

    from slime.accelerator import get_accelerator

    get_accelerator().check_and_update_config(args)  # device policy (CPU: each worker's share of the cores)
    with library_signal_handlers_reclaimed():  # ray.init replaces the SIGTERM handler
        init_ray(args.num_cpus)
    from slime.utils import exits, run_identity

    raylet = exits.local_ray_node_pids().get("raylet")
    if raylet:  # a SIGKILLed driver leaves its agents behind: the next run of this dir stops them
        run_identity.record_processes(args.output_dir, [raylet], "raylet", node_id=exits.local_ray_node_id())
    slots = create_placement_groups(args)
    handles: dict[str, Any] = {}  # filled as they start, so a failure still stops what is running
    try:
        if args.debug_rollout_only:  # no trainer rank at all (slime.debug_modes)
            from slime.debug_modes import run_rollout_only

            return run_rollout_only(args, handles, slots)
        handles["actor"] = RayTrainGroup(args, slots["actor"])
        from slime.utils.run_identity import record_processes

        record_processes(args.output_dir, handles["actor"].pids, "trainer")  # freed by the next run if killed
        _trainer_pids[:] = handles["actor"].pids
        records = (loop or _run)(args, handles, slots)
        if args.async_save:  # the last checkpoint's files may still be being written: published before the run ends
            handles["actor"].finish_save()
        return records
    finally:
        _cleanup(handles.get("actor"), handles.get("rollout"), slots)


def _cleanup(actor, rollout, slots) -> None:
    """Stop engines and trainer actors, free the placement group and the trainer ranks' shared memory
    (the Ray session may go on). Runs after success, errors and signals alike; a second signal
    meanwhile does not cut it short."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from slime.accelerator import get_accelerator
    from slime.utils import exits

    def around_ray() -> bool:
        """The signal reached Ray's GCS/raylet too (checked before every Ray call: one would hang for 60 s,
        holding the interpreter): stop the session's processes by pid instead."""
        if not exits.ray_core_dead():
            return False
        exits.kill_session_processes(exits.local_ray_node_pids().get("raylet"))
        if actor is not None:
            get_accelerator().release_ipc_memory(actor.pids)
        return True

    with exits.signals_deferred():
        if around_ray():
            return
        if actor is not None:  # first: a distributed weight sync tells the engines to leave its group
            actor.shutdown()
        if rollout is not None:
            if around_ray():
                return
            try:
                ray.get(rollout.shutdown.remote(), timeout=60)
            except Exception as e:
                logger.warning("rollout shutdown: %s", str(e).splitlines()[0] if str(e) else e)
            ray.kill(rollout)
        if around_ray():
            return
        try:
            remove_placement_group(slots["actor"].pg)
        except Exception as e:
            logger.warning("placement group removal: %s", e)
        if actor is not None:
            get_accelerator().release_ipc_memory(actor.pids)


def _run(args, handles: dict[str, Any], slots) -> list[dict[str, Any]]:
    import ray

    from slime.ray.rollout import create_rollout_manager
    from slime.rollout.evaluation import eval_steps
    from slime.utils.metrics import MetricsLogger
    from slime.utils.tracking import Tracker

    actor = handles["actor"]
    # Trainer first: in colocated mode the engines then start on devices the trainer already holds.
    start_rollout_id = actor.init("actor", with_ref=args.use_ref_model)
    if args.start_rollout_id is not None:  # upstream's --start-rollout-id overrides the resumed position
        start_rollout_id = args.start_rollout_id
    rollout = handles["rollout"] = create_rollout_manager(args, slots["rollout"])
    records: list[dict[str, Any]] = []
    if start_rollout_id > 0:
        extra = actor.load_extra_state() or {}
        if extra.get("data_source") is not None:
            ray.get(rollout.load_state.remote(extra["data_source"]))
    engines = not args.debug_train_only  # --debug-train-only: no engine to connect to, route to or sync
    if engines:
        mode = actor.connect_rollout_engines(ray.get(rollout.engines.remote()))
        logger.info("weight sync mode: %s", mode)
        logger.info("%s", ray.get(rollout.routing.remote()))
        # An engine restarted mid-rollout gets the trainer's current weights before it serves again.
        ray.get(rollout.set_weight_source.remote(actor.actors, bool(args.offload_train)))
    # The engine check before each sync runs during training where it gives the engines no memory back (no
    # --offload-rollout, or the engines' memory is the host's): its Ray round trips then cost no time. An
    # engine that dies after it fails the sync, which checks again and syncs once more (_sync_weights).
    early_check = engines and (not args.offload_rollout or ray.get(rollout.engines_memory_is_host.remote()))
    if args.load and engines:  # engines start from --hf-checkpoint; weights from --load (resume, --finetune, HF) may differ
        actor.update_weights(start_rollout_id, ray.get(rollout.engines.remote()))

    log = MetricsLogger(args.output_dir, resume_from=start_rollout_id if args.load else None)
    tracker = Tracker(args)
    evals = eval_steps(args, start_rollout_id)
    if 0 in evals:
        _evaluate(rollout, log, tracker, 0)
    for rollout_id in range(start_rollout_id, args.num_rollout):
        t_iter = time.perf_counter()
        driver_cpu = time.thread_time()
        t0 = time.perf_counter()
        # --offload-rollout: the manager releases the engines' memory at the end of the same call
        offload = {"offload": True} if args.offload_rollout else {}
        result = _wait_with_progress(rollout.generate.remote(rollout_id, **offload), rollout,
                                     args.rollout_batch_size * args.n_samples_per_prompt)
        elapsed = time.perf_counter() - t0
        # The samples stay in the object store (result["data"]); the driver sees their summary only.
        metrics: dict[str, Any] = {"rollout_id": rollout_id, "time/rollout": elapsed}
        metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))})
        metrics["perf/rollout_tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(elapsed, 1e-9)
        if args.offload_train:
            actor.onload()

        reuse = reuses_train_log_probs(args, int(result["num_samples"]))
        metrics["train/reused_log_probs"] = float(reuse)
        check = rollout.check_engines.remote() if early_check else None
        t_call = time.perf_counter()
        metrics.update(actor.train_rollout(rollout_id, result["data"], reuse))
        # log-probs + advantages + train, plus Ray and data transfer
        metrics["time/train_call"] = time.perf_counter() - t_call
        if args.offload_rollout and not engines:
            ray.get(rollout.onload.remote())
        # Engines that died since the rollout are restarted now (this sync gives them the weights); the
        # list may differ from the rollout's (a restarted engine may have a new port). --offload-rollout:
        # the engines get their memory back in the same call.
        t_call = time.perf_counter()
        if engines:
            metrics.update(_sync_weights(actor, rollout, rollout_id + 1, metrics,
                                         onload=bool(args.offload_rollout) and check is None, check=check))
        else:
            metrics["time/weight_sync"] = 0.0  # as train_async.py's records without a sync
        metrics["time/weight_sync_call"] = time.perf_counter() - t_call
        if args.offload_train:
            actor.offload()

        metrics["time/save"] = 0.0
        if _should_save(args, rollout_id):
            state = ray.get(rollout.state.remote())
            metrics.update(actor.save(rollout_id, {"data_source": state, "rollout_id": rollout_id}))
        _close_iteration(metrics, t_iter, driver_cpu, log, tracker, records, args.num_rollout)
        if rollout_id + 1 in evals:  # on the weights just synced to the engines
            _evaluate(rollout, log, tracker, rollout_id + 1)
    tracker.close()
    return records


def _sync_weights(actor, rollout, version: int, metrics: dict[str, Any], onload: bool = False,
                  check=None) -> dict[str, Any]:
    """Push the trainer's weights to the engines. An engine that died since the rollout is restarted first; one
    that dies during the sync fails it: then it is restarted and the sync runs once more (all-or-nothing per
    engine, so a repeat is safe). Restart counts add to `metrics`. onload: the engines' memory comes back
    first, in the same call as the check (--offload-rollout). check: that check's reply, already asked for
    (an object reference)."""
    import ray

    if check is None:
        check = rollout.check_engines.remote(onload=True) if onload else rollout.check_engines.remote()
    health = ray.get(check)
    for attempt in (0, 1):
        engines = health.pop("engines")
        for key, value in health.items():
            metrics[key] = metrics.get(key, 0.0) + value
        try:
            out = actor.update_weights(version, engines)
        except Exception as e:
            health = ray.get(rollout.check_engines.remote())
            if attempt or not health.get("rollout/engine_restarts"):
                raise
            logger.warning("weight sync %d failed on an engine that died meanwhile (restarted); syncing again: %s",
                           version, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            continue
        if actor.args.keep_old_actor:  # the kept copies move on after each sync (upstream's queue)
            actor.advance_old_actor()
        return out
    raise AssertionError("unreachable")


def _close_iteration(metrics: dict[str, Any], t_iter: float, driver_cpu: float, log, tracker,
                     records: list[dict[str, Any]], num_rollout: int) -> None:
    """End one rollout's record (both loops): its times, metrics.jsonl, the tracker and the console line."""
    from slime.utils.metrics import console_line

    metrics["time/iteration"] = time.perf_counter() - t_iter
    # CPU time of the loop thread only: Ray's own threads in this process tick with wall time, not with work
    metrics["time/driver_cpu"] = time.thread_time() - driver_cpu
    log.log(metrics)
    tracker.log(metrics, int(metrics["rollout_id"]) + 1)
    records.append(metrics)
    print(console_line(metrics, num_rollout), flush=True)


def _evaluate(rollout, log, tracker, step: int) -> dict[str, Any]:
    """Eval rollouts after `step` trained rollouts; one metrics.jsonl record of kind "eval"."""
    import ray

    from slime.utils.metrics import eval_console_line

    record = {"kind": "eval", "eval_step": step, "rollout_id": step - 1, **ray.get(rollout.eval.remote(step))}
    log.log(record)
    tracker.log(record, step)
    print(eval_console_line(record), flush=True)
    return record


def main(argv: Sequence[str] | None = None, train_fn=None) -> int:
    """Exit status: 0 done, 1 error (one line; SLIME_DEBUG=1 for the traceback), 2 bad input found
    before Ray starts, 130/143 after SIGINT/SIGTERM (engines, trainer ranks and shared memory released)."""
    from slime.utils import exits

    _setup_logging()
    # first: a signal while parsing or in preflight also exits 128 + N, one line
    with exits.stop_handling(_take_over_stop):
        try:
            code = _main(argv, train_fn or train)
        except exits.Interrupted as e:  # before Ray started (later ones are handled with the cleanup in _main)
            print(f"train.py: {e.name}: stopped; exit {e.exit_code}", file=sys.stderr, flush=True)
            return e.exit_code
    if code >= 128 and exits.ray_core_dead():  # interpreter exit would run Ray's hooks, which wait for the GCS
        sys.stdout.flush()
        os._exit(code)
    return code


_trainer_pids: list[int] = []  # the run's trainer ranks, for a cleanup that cannot go through Ray


def _stop_line(name: str, code: int) -> str:
    return f"train.py: {name}: stopped the engines and trainer ranks, released their shared memory; exit {code}"


def _take_over_stop(signum: int) -> bool:
    """The watchdog's cleanup when the main thread is stuck in a Ray call after the signal killed Ray's own
    processes too: stop the session's processes and free the trainer ranks' shared memory directly."""
    from slime.accelerator import get_accelerator
    from slime.utils import exits

    if not exits.ray_core_dead():
        return False  # Ray answers: the main thread's cleanup goes through it
    exits.kill_session_processes(exits.local_ray_node_pids().get("raylet"))
    get_accelerator().release_ipc_memory(_trainer_pids)
    exits.hard_exit(128 + signum, _stop_line(signal.Signals(signum).name, 128 + signum))
    return True


def _main(argv: Sequence[str] | None, train_fn=None) -> int:
    from slime.utils import exits
    from slime.config.arguments import parse_args
    from slime.config.preflight import PreflightError, run_preflight

    args = parse_args(argv)
    from slime.dry_run import run, runtime_warnings
    from slime.config.arguments import build_parser

    if args.dry_run:  # flags against config.json only: no preflight of paths (missing ones are warnings), no Ray
        return run(args, build_parser())
    try:
        preflight = run_preflight(args)
    except PreflightError as e:
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    for line in preflight.lines(args):
        print(line, flush=True)
    _start_run(args, preflight)
    for line in runtime_warnings(args, build_parser()):
        logger.warning(line)
    from slime.accelerator import DeviceConfigError, get_accelerator

    try:  # after the warnings: it also turns off what the device lacks (SGLang graph capture)
        get_accelerator().check_and_update_config(args)
    except DeviceConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    if preflight.resume_iteration is not None and preflight.resume_iteration + 1 >= args.num_rollout:
        print(f"nothing to do: {args.load} already holds rollout {preflight.resume_iteration} (--num-rollout "
              f"{args.num_rollout}); raise --num-rollout to continue", flush=True)
        return 0  # found before Ray starts
    if not exits.debug():
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # errors reach the console once, below
    started_ray = False
    try:
        import ray

        from slime.ray.placement_group import joins_ray_cluster

        started_ray = not ray.is_initialized() and not joins_ray_cluster()
        records = (train_fn or train)(args)
    except BaseException as e:  # noqa: BLE001 - every way out gets one line and a status
        stop = exits.interruption(e)
        if stop is not None:
            print(_stop_line(stop.name, stop.exit_code), file=sys.stderr, flush=True)
            exits.mark_exit_reported()
            return stop.exit_code
        if exits.debug() or not isinstance(e, Exception):
            raise
        from slime.accelerator.cli import EXIT_CODE, one_line, setup_error

        if setup_error(e) is not None:  # an unmet device request or a stale patch set: set-up, exit 2
            print(one_line(setup_error(e)), file=sys.stderr, flush=True)
            return EXIT_CODE
        for line in exits.describe_error(e):
            print(f"train.py: error: {line}" if not line.startswith("  |") else line, file=sys.stderr, flush=True)
        return 1
    finally:
        if started_ray:
            _shutdown_ray()
    if records:
        rewards = [r["rollout/reward_mean"] for r in records]
        k = max(1, min(5, len(rewards) // 4))
        print(f"reward: first {rewards[0]:.3f} -> last {rewards[-1]:.3f} (mean of first {k}: "
              f"{sum(rewards[:k]) / k:.3f}, last {k}: {sum(rewards[-k:]) / k:.3f}) over {len(records)} iterations; "
              f"metrics in {os.path.join(args.output_dir, 'metrics.jsonl')}", flush=True)
    return 0


def _start_run(args, preflight) -> None:
    """Before Ray: free what a killed earlier run of this output dir left (its trainer ranks' shared memory),
    discard the records of a restarted run's unsaved rollouts, and write this run's identity."""
    from slime.utils import run_identity

    freed = run_identity.release_stale_memory(args.output_dir)
    if freed:
        logger.info("released %d shared-memory files of an earlier run's dead trainer ranks", freed)
    if preflight.restart_records:
        run_identity.discard_unsaved_records(args.output_dir)
    run_identity.start_run(args)


def _shutdown_ray() -> None:
    """Stop the local Ray session this process started (its raylet, object store and agents)."""
    import ray

    from slime.utils import exits

    with exits.signals_deferred():
        raylet = exits.local_ray_node_pids().get("raylet")
        if not exits.ray_core_dead():  # else ray.shutdown would wait for the GCS
            try:
                ray.shutdown()
            except Exception as e:  # noqa: BLE001 - exiting anyway
                logger.warning("ray shutdown: %s", e)
        # what ray.shutdown leaves (agents that outlive the raylet for up to a minute, workers of a dead raylet)
        exits.kill_session_processes(raylet)


if __name__ == "__main__":
    sys.exit(main())
