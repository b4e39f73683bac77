"""train.py's command line: `python train.py ...` (also `python -m slime.train`), and train_async.py's (its main
passes its own loop and one refusal). Parses once, checks the input before Ray starts (one line, exit 2), runs
the loop under slime.run.launch, and turns every way out into one line and an exit status.

    python train.py --hf-checkpoint DIR --num-rollout N ...

train.py's loop is the synchronous one (slime.run.synchronous): rollout -> rewards -> old/ref log-probs ->
advantages -> train -> weight sync -> save; --debug-rollout-only runs slime.run.rollout_only instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable, Sequence

from slime.run.session import reuses_train_log_probs  # noqa: F401 - its documented place (docs/training.md)

logger = logging.getLogger("slime.train")


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("SLIME_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def train(args) -> list[dict[str, Any]]:
    """Run train.py's loop (the synchronous one; --debug-rollout-only: rollouts only); returns the per-iteration
    metric records (also in OUTPUT_DIR/metrics.jsonl)."""
    from slime.config.device_policy import apply_device_policy
    from slime.run import rollout_only, synchronous
    from slime.run.launch import launch

    apply_device_policy(args)  # a no-op after main()'s preparation; args handed in directly get it here
    return launch(args, rollout_only.run if args.debug_rollout_only else synchronous.run)


def _run(args, handles: dict[str, Any], slots) -> list[dict[str, Any]]:
    """The synchronous loop on a trainer group that is already running (handles["actor"]), without Ray's start-up
    or the clean-up: tests drive it with stand-in trainer ranks and rollout manager."""
    from slime.run import synchronous
    from slime.run.session import RunSession

    return synchronous.run(RunSession(args, slots, actor=handles["actor"]))


Refusal = Callable[[Any], "str | None"]  # a program's own check of the parsed flags: its error line, or None


def main(argv: Sequence[str] | None = None, train_fn=None, refuse: Refusal | None = None) -> int:
    """Exit status: 0 done, 1 error (one line; SLIME_DEBUG=1 for the traceback), 2 bad input found
    before Ray starts, 130/143 after SIGINT/SIGTERM (engines, trainer ranks and shared memory released).
    train_fn(args) runs the loop (default train.py's); refuse(args) is the program's own check of the flags,
    right after parsing (its line is printed as is)."""
    from slime.utils import exits

    _setup_logging()
    # first: a signal while parsing or in preflight also exits 128 + N, one line
    with exits.stop_handling(_take_over_stop):
        try:
            code = _main(argv, train_fn or train, refuse)
        except exits.Interrupted as e:  # before Ray started (later ones are handled with the cleanup in _main)
            print(f"train.py: {e.name}: stopped; exit {e.exit_code}", file=sys.stderr, flush=True)
            return e.exit_code
    if code >= 128 and exits.ray_core_dead():  # interpreter exit would run Ray's hooks, which wait for the GCS
        sys.stdout.flush()
        os._exit(code)
    return code


def _stop_line(name: str, code: int) -> str:
    return f"train.py: {name}: stopped the engines and trainer ranks, released their shared memory; exit {code}"


def _take_over_stop(signum: int) -> bool:
    """The watchdog's cleanup when the main thread is stuck in a Ray call after the signal killed Ray's own
    processes too: stop the session's processes and free the trainer ranks' shared memory directly."""
    from slime.accelerator import get_accelerator
    from slime.run.session import TRAINER_PIDS
    from slime.utils import exits

    if not exits.ray_core_dead():
        return False  # Ray answers: the main thread's cleanup goes through it
    exits.kill_session_processes(exits.local_ray_node_pids().get("raylet"))
    get_accelerator().release_ipc_memory(TRAINER_PIDS)
    exits.hard_exit(128 + signum, _stop_line(signal.Signals(signum).name, 128 + signum))
    return True


def _main(argv: Sequence[str] | None, train_fn=None, refuse: Refusal | None = None) -> int:
    prepared = _prepare(argv, refuse)
    if isinstance(prepared, int):
        return prepared
    return _run_program(prepared, train_fn or train)


def _prepare(argv: Sequence[str] | None, refuse: Refusal | None):
    """The command line parsed once and checked before Ray starts: the parsed args, or the exit status to return
    (2 bad input, 0 nothing to do or a dry run done)."""
    from slime.config.arguments import build_parser, parse_args
    from slime.config.preflight import PreflightError, run_preflight
    from slime.dry_run import run, runtime_warnings

    args = parse_args(argv)
    refused = refuse(args) if refuse is not None else None
    if refused:
        print(refused, file=sys.stderr, flush=True)
        return 2
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
    from slime.accelerator import DeviceConfigError
    from slime.config.device_policy import apply_device_policy

    try:  # once per run (launch finds it applied); after the warnings, which name the flags as given
        apply_device_policy(args)
    except DeviceConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    if preflight.resume_iteration is not None and preflight.resume_iteration + 1 >= args.num_rollout:
        print(f"nothing to do: {args.load} already holds rollout {preflight.resume_iteration} (--num-rollout "
              f"{args.num_rollout}); raise --num-rollout to continue", flush=True)
        return 0  # found before Ray starts
    return args


def _run_program(args, train_fn) -> int:
    """The run itself (Ray started here unless this process joined a session or cluster, and stopped after):
    every way out becomes one line and an exit status."""
    from slime.utils import exits

    if not exits.debug():
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # errors reach the console once, below
    started_ray = False
    try:
        import ray

        from slime.ray.placement_group import joins_ray_cluster

        started_ray = not ray.is_initialized() and not joins_ray_cluster()
        records = train_fn(args)
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
    from slime.utils.exits import end_entry_point

    end_entry_point(main())
