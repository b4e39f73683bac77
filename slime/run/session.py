"""RunSession: the one owner of an RL run's handles and of what every loop does alike.

It holds the trainer group (Megatron ranks), the rollout manager (engine fleet and data path) and the
placement they run on, and it does the shared steps: start-up and resume, the engines' connection, waiting
for a rollout, the reused-log-probs decision, the weight sync with its one retry, checkpoints, evaluation,
metrics.jsonl, the tracker and the console line. A loop (slime.run.synchronous, .one_step_off, .rollout_only)
decides only the order of these steps; slime.run.launch starts Ray before and cleans up after.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("slime.train")

# The run's trainer ranks, for a cleanup that cannot go through Ray (slime.train's signal watchdog, when the
# signal also killed Ray's own processes). Kept after the run: releasing a dead rank's memory twice is harmless.
TRAINER_PIDS: list[int] = []


def reuses_train_log_probs(args, num_samples: int) -> bool:
    """Whether the first training forward's detached log-probs can serve as the old log-probs, saving the
    separate old-policy forward: exactly one optimizer step per rollout (so that forward runs on the weights
    that generated the rollout, like the old-policy forward would), nothing needs them before training (no
    KL-shaped reward), the engine's log-probs do not replace them (--use-rollout-logprobs) and no dropout."""
    kl_in_reward = (args.advantage_estimator.startswith("reinforce_plus_plus") or args.advantage_estimator == "ppo") \
        and args.kl_coef > 0
    if args.use_opd or args.use_rollout_entropy:  # the OPD term / the hooks read them (and the entropy) before training
        return False
    # at most one step: steps take --global-batch-size rollouts, of one sample or more (the trainer counts them)
    one_step = num_samples // args.global_batch_size <= 1
    # with --hidden-dropout the training forward is stochastic; old log-probs need the deterministic one
    # --keep-old-actor: the old log-probs come from the kept copy, not from the weights being trained
    return (one_step and not kl_in_reward and not args.use_rollout_logprobs and args.hidden_dropout == 0
            and not args.keep_old_actor)


def wait_with_progress(ref, rollout, total: int, after_s: float = 2.0):
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


@dataclass(frozen=True)
class SavePoint:
    """A checkpoint due after `rollout_id`, with the data source's position at that point (None: no data source,
    e.g. rollouts replayed from files)."""

    rollout_id: int
    data_state: dict[str, Any] | None


@dataclass
class RunSession:
    """One run. `slots` is the placement (slime.ray.placement_group); `actor` the trainer group (RayTrainGroup,
    started by start_trainer unless given), `rollout` the rollout manager (a Ray actor, start_rollout). `start`
    is the first rollout id this run generates; `records` the per-iteration metric records, in order."""

    args: Any
    slots: Any
    actor: Any = None
    rollout: Any = None
    start: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    log: Any = None  # MetricsLogger: OUTPUT_DIR/metrics.jsonl
    tracker: Any = None  # wandb / tensorboard, as configured
    evals: set[int] = field(default_factory=set)  # rollouts trained after which the engines are evaluated
    # the open iteration's wall clock and loop-thread CPU time (begin_iteration)
    _clock: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)
    _trained: bool = field(default=False, init=False, repr=False)  # a training step ran (the first one is announced)

    @property
    def engines(self) -> bool:
        """Whether there are engines to connect to, route to and sync (not under --debug-train-only)."""
        return not self.args.debug_train_only

    # --- start-up -----------------------------------------------------------------------------------------------

    def start_trainer(self) -> int:
        """The trainer group (its ranks recorded, so that the next run of this output dir frees what a killed one
        leaves) and its init: the model, optimizer and, on resume, the checkpoint. Sets and returns `start`.
        First: in colocated mode the engines then start on devices the trainer already holds."""
        from slime.utils.stages import stage

        with stage(f"starting the trainer: {self.args.world_size} rank(s) build the model and the optimizer"
                   + (" and load the checkpoint" if self.args.load else "")):
            if self.actor is None:
                from slime.ray.actor_group import RayTrainGroup
                from slime.utils.run_identity import record_processes

                self.actor = RayTrainGroup(self.args, self.slots["actor"])
                record_processes(self.args.output_dir, self.actor.pids, "trainer")
                TRAINER_PIDS[:] = self.actor.pids
            self.start = self.actor.init("actor", with_ref=self.args.use_ref_model)
        if self.args.start_rollout_id is not None:  # upstream's --start-rollout-id overrides the resumed position
            self.start = self.args.start_rollout_id
        return self.start

    def start_rollout(self) -> None:
        """The rollout manager and its engines; on resume, the data source's position from the checkpoint."""
        import ray

        import slime.ray.rollout as rollout_module  # by module: tests stand a manager in for create_rollout_manager

        from slime.utils.stages import stage

        with stage(f"starting the rollout engines ({self.args.rollout_engine_kind})"):
            self.rollout = rollout_module.create_rollout_manager(self.args, self.slots["rollout"])
        if self.start > 0 and self.actor is not None:
            extra = self.actor.load_extra_state() or {}
            if extra.get("data_source") is not None:
                ray.get(self.rollout.load_state.remote(extra["data_source"]))

    def connect_engines(self) -> None:
        """The trainer learns the engines (the weight-sync mode follows from them), and the manager the trainer
        ranks: an engine restarted mid-rollout gets the trainer's current weights before it serves again."""
        import ray

        mode = self.actor.connect_rollout_engines(ray.get(self.rollout.engines.remote()))
        logger.info("weight sync mode: %s", mode)
        logger.info("%s", ray.get(self.rollout.routing.remote()))
        ray.get(self.rollout.set_weight_source.remote(self.actor.actors, bool(self.args.offload_train)))

    def push_weights(self, version: int) -> None:
        """The trainer's weights to the engines as `version`, with no engine check (start-up: they just started)."""
        import ray

        self.actor.update_weights(version, ray.get(self.rollout.engines.remote()))

    def open_metrics(self, resume: bool = True) -> None:
        """metrics.jsonl (resume: a resumed run keeps its records before `start`; else a fresh file), the tracker
        and the evaluation schedule; the evaluation before training when it is due."""
        from slime.rollout.evaluation import eval_steps
        from slime.utils.metrics import MetricsLogger
        from slime.utils.tracking import Tracker

        self.log = MetricsLogger(self.args.output_dir, resume_from=self.start if resume and self.args.load else None)
        self.tracker = Tracker(self.args)
        self.evals = eval_steps(self.args, self.start)
        self.evaluate_if_due(0)

    # --- one iteration ------------------------------------------------------------------------------------------

    def rollout_ids(self) -> range:
        return range(self.start, self.args.num_rollout)

    def begin_iteration(self, rollout_id: int) -> dict[str, Any]:
        """Starts the iteration's clocks; returns its record, to be filled and then closed (close_iteration)."""
        self._clock = (time.perf_counter(), time.thread_time())
        return {"rollout_id": rollout_id}

    def wait_for_rollout(self, ref) -> dict[str, Any]:
        """A generation's reply (its samples stay in the object store, result["data"]: the driver sees their
        summary only)."""
        return wait_with_progress(ref, self.rollout, self.args.rollout_batch_size * self.args.n_samples_per_prompt)

    def generate(self, rollout_id: int, **options) -> tuple[dict[str, Any], float]:
        """Generates rollout `rollout_id` and waits for it; returns the reply and the seconds it took."""
        t0 = time.perf_counter()
        result = self.wait_for_rollout(self.rollout.generate.remote(rollout_id, **options))
        return result, time.perf_counter() - t0

    @staticmethod
    def add_rollout_metrics(metrics: dict[str, Any], result: dict[str, Any], elapsed: float) -> None:
        """The rollout's numeric metrics and its time into the record."""
        metrics["time/rollout"] = elapsed
        metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))})
        metrics["perf/rollout_tokens_per_s"] = metrics.get("rollout/response_tokens", 0.0) / max(elapsed, 1e-9)

    def train(self, rollout_id: int, result: dict[str, Any], metrics: dict[str, Any], check_engines: bool = False,
              wall_clock: bool = False):
        """One rollout's training call (old/ref log-probs, advantages, the optimizer steps) on the trainer's
        devices (--offload-train: onloaded first). check_engines: the engine check before the next sync is
        asked for now, to run during training; its reference is returned (else None). wall_clock: the record
        also gets the call's wall-clock bounds (train/start_time, train/end_time)."""
        if self.args.offload_train:
            self.actor.onload()
        reuse = reuses_train_log_probs(self.args, int(result["num_samples"]))
        metrics["train/reused_log_probs"] = float(reuse)
        check = self.rollout.check_engines.remote() if check_engines else None
        if wall_clock:
            metrics["train/start_time"] = time.time()
        t_call = time.perf_counter()
        if self._trained:
            metrics.update(self.actor.train_rollout(rollout_id, result["data"], reuse))
        else:  # the first step also allocates the optimizer state and the kernels' workspaces: the slow one
            from slime.utils.stages import stage

            with stage(f"training on rollout {rollout_id} (the first training step of this run)"):
                metrics.update(self.actor.train_rollout(rollout_id, result["data"], reuse))
            self._trained = True
        # log-probs + advantages + train, plus Ray and data transfer
        metrics["time/train_call"] = time.perf_counter() - t_call
        if wall_clock:
            metrics["train/end_time"] = time.time()
        return check

    def sync_weights(self, version: int, metrics: dict[str, Any], onload: bool = False, check=None) -> None:
        """Push the trainer's weights to the engines. An engine that died since the rollout is restarted first;
        one that dies during the sync fails it: then it is restarted and the sync runs once more (all-or-nothing
        per engine, so a repeat is safe). The sync's metrics and restart counts go into `metrics`. onload: the
        engines' memory comes back first, in the same call as the check (--offload-rollout). check: that check's
        reply, already asked for (an object reference)."""
        import ray

        if check is None:
            check = self.rollout.check_engines.remote(onload=True) if onload else self.rollout.check_engines.remote()
        health = ray.get(check)
        for attempt in (0, 1):
            engines = health.pop("engines")
            for key, value in health.items():
                metrics[key] = metrics.get(key, 0.0) + value
            try:
                out = self.actor.update_weights(version, engines)
            except Exception as e:
                health = ray.get(self.rollout.check_engines.remote())
                if attempt or not health.get("rollout/engine_restarts"):
                    raise
                logger.warning("weight sync %d failed on an engine that died meanwhile (restarted); syncing again: %s",
                               version, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
                continue
            if self.args.keep_old_actor:  # the kept copies move on after each sync (upstream's queue)
                self.actor.advance_old_actor()
            metrics.update(out)
            return
        raise AssertionError("unreachable")

    def save_point(self, rollout_id: int) -> SavePoint | None:
        """When a checkpoint is due after this rollout: the data source's position now, which a resume from that
        checkpoint continues from (read before the next rollout takes its prompts); else None."""
        import ray

        args = self.args
        last = rollout_id == args.num_rollout - 1
        if not args.save or not (last or (args.save_interval is not None and (rollout_id + 1) % args.save_interval == 0)):
            return None
        return SavePoint(rollout_id, ray.get(self.rollout.state.remote()))

    def save(self, point: SavePoint | None, metrics: dict[str, Any]) -> None:
        """The checkpoint of a save point (none: nothing is due)."""
        metrics["time/save"] = 0.0
        if point is not None:
            extra = {"data_source": point.data_state, "rollout_id": point.rollout_id}
            metrics.update(self.actor.save(point.rollout_id, extra))

    def close_iteration(self, metrics: dict[str, Any]) -> None:
        """End one rollout's record: its times, metrics.jsonl, the tracker and the console line."""
        from slime.utils.metrics import console_line

        t_iter, driver_cpu = self._clock
        metrics["time/iteration"] = time.perf_counter() - t_iter
        # CPU time of the loop thread only: Ray's own threads in this process tick with wall time, not with work
        metrics["time/driver_cpu"] = time.thread_time() - driver_cpu
        self.log.log(metrics)
        self.tracker.log(metrics, int(metrics["rollout_id"]) + 1)
        self.records.append(metrics)
        print(console_line(metrics, self.args.num_rollout), flush=True)

    # --- evaluation and the end -------------------------------------------------------------------------------------

    def evaluate_if_due(self, step: int) -> dict[str, Any] | None:
        """Eval rollouts after `step` trained rollouts, when the schedule has them; one metrics.jsonl record of
        kind "eval"."""
        if step not in self.evals:
            return None
        import ray

        from slime.utils.metrics import eval_console_line

        record = {"kind": "eval", "eval_step": step, "rollout_id": step - 1, **ray.get(self.rollout.eval.remote(step))}
        self.log.log(record)
        self.tracker.log(record, step)
        print(eval_console_line(record), flush=True)
        return record

    def finish(self) -> list[dict[str, Any]]:
        """The tracker closed; the run's records."""
        self.tracker.close()
        return self.records
