"""Profiling of the trainer ranks with upstream slime's flags (slime.config.observability_args).

--use-pytorch-profiler with --profile-target:
- train_overall: one torch.profiler run over the whole training, a step per rollout;
- train_actor: a profiler per rollout's training, a step per optimizer step;
- train_log_probs: a profiler per rollout, a step per log-prob pass (old policy, reference, ...).
train_overall spans the others, so it is profiled alone (torch.profiler runs one session at a time).
Each records steps [--profile-step-start, --profile-step-end) of its own count (the earlier ones wait, the one
before is warm-up) and writes a TensorBoard trace (gzip JSON) named <target>_rank_<rank> to --tensorboard-dir,
on the ranks of --profile-ranks. The activities are the accelerator's (host, plus its device's).

--record-memory-history records the device allocator from start-up; the history is written to
--memory-snapshot-dir after --memory-snapshot-num-steps rollouts, or when the trainer shuts down. A
device without such a history (the host) gets one warning line. --memory-recorder memray records host
allocations with memray instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Iterator

import torch

from slime.accelerator import get_accelerator

logger = logging.getLogger(__name__)


def _trace_dir(args) -> str:
    return args.tensorboard_dir or os.path.join(args.output_dir, "tensorboard")


def _activities() -> list:
    """The host's activity, and the accelerator's device's: CUDA has its own; an out-of-tree device (Ascend's
    "npu") records as PrivateUse1."""
    activity = torch.profiler.ProfilerActivity
    kind = get_accelerator().device_type
    if kind == "cpu":
        return [activity.CPU]
    device = getattr(activity, kind.upper(), None) or getattr(activity, "PrivateUse1", None)
    return [activity.CPU] + ([device] if device is not None else [])


class _Target:
    """One torch.profiler for a target, stepped by its own count."""

    def __init__(self, args, name: str, rank: int) -> None:
        start, end = args.profile_step_start, args.profile_step_end
        self.profiler = torch.profiler.profile(
            activities=_activities(),
            schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                             active=end - start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                _trace_dir(args), worker_name=f"{name}_rank_{rank}", use_gzip=True),
            record_shapes=True, profile_memory=True, with_flops=True)
        self.profiler.start()

    def step(self) -> None:
        self.profiler.step()

    def stop(self) -> None:
        self.profiler.stop()


class TrainProfiler:
    def __init__(self, args, rank: int) -> None:
        self.args, self.rank = args, rank
        self.on = bool(args.use_pytorch_profiler) and rank in args.profile_ranks
        self._overall: _Target | None = None
        self._log_probs: _Target | None = None  # train_log_probs: this rollout's, between its passes
        self._memory = _MemoryRecorder.create(args, rank) if args.record_memory_history else None
        if self._memory is not None:
            self._memory.start()

    def _wants(self, target: str) -> bool:
        return self.on and target in self.args.profile_target

    def on_init_end(self) -> None:
        if self._wants("train_overall"):
            self._overall = _Target(self.args, "train_overall", self.rank)

    def step(self, rollout_id: int) -> None:
        """After a rollout's training."""
        if self._overall is not None:
            self._overall.step()
        steps = self.args.memory_snapshot_num_steps
        if self._memory is not None and steps is not None and rollout_id == steps - 1:
            self._memory.stop()

    def steps(self, target: str, items) -> Iterator[Any]:
        """`items`, with a profiler step after each when `target` is profiled."""
        if not self._wants(target):
            yield from items
            return
        prof = _Target(self.args, target, self.rank)
        try:
            for item in items:
                yield item
                prof.step()
        finally:
            prof.stop()

    @contextlib.contextmanager
    def log_probs_pass(self):
        """One log-prob pass as a train_log_probs step (a profiler per rollout, stepped by each pass)."""
        if not self._wants("train_log_probs"):
            yield
            return
        if self._log_probs is None:
            self._log_probs = _Target(self.args, "train_log_probs", self.rank)
        yield
        self._log_probs.step()

    def end_log_probs(self) -> None:
        """A rollout's log-prob passes are over (its training starts): the train_log_probs profiler writes
        what it has, before another profiler may start (torch.profiler runs one session at a time)."""
        if self._log_probs is not None:
            self._log_probs.stop()
            self._log_probs = None

    def close(self) -> None:
        for prof in (self._overall, self._log_probs):
            if prof is not None:
                prof.stop()
        self._overall = self._log_probs = None
        if self._memory is not None:
            self._memory.stop()


class _MemoryRecorder:
    @staticmethod
    def create(args, rank: int) -> "_MemoryRecorder":
        return {"torch": _DeviceMemoryHistory, "memray": _MemrayRecorder}[args.memory_recorder](args, rank)

    def __init__(self, args, rank: int) -> None:
        os.makedirs(args.memory_snapshot_dir, exist_ok=True)
        self.path = os.path.join(args.memory_snapshot_dir,
                                 f"memory_snapshot_time{time.time():.0f}_rank{rank}_{args.memory_snapshot_path}")
        self.recording = False

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class _DeviceMemoryHistory(_MemoryRecorder):
    def start(self) -> None:
        acc = get_accelerator()
        self.memory = acc.memory_history_module()
        if self.memory is None:
            logger.warning("--record-memory-history: %s keeps no allocator history; nothing is recorded", acc.name)
            return
        self.memory._record_memory_history(max_entries=1_000_000, stacks="all")
        self.recording = True

    def stop(self) -> None:
        if not self.recording:
            return
        self.memory._dump_snapshot(self.path)
        self.memory._record_memory_history(enabled=None)
        self.recording = False
        logger.info("memory history written to %s", self.path)


class _MemrayRecorder(_MemoryRecorder):
    def start(self) -> None:
        import memray

        self._tracker = memray.Tracker(file_name=self.path, native_traces=True)
        self._tracker.__enter__()
        self.recording = True

    def stop(self) -> None:
        if self.recording:
            self._tracker.__exit__(None, None, None)
            self.recording = False
