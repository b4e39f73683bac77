"""Experiment tracking next to metrics.jsonl: Weights & Biases (`--use-wandb`, when installed) and
TensorBoard (`--use-tensorboard`, when installed). A missing package is one warning line at start-up
and the run goes on with metrics.jsonl only."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tracking_warnings(args: Any) -> list[str]:
    out = []
    if args.use_wandb and not _installed("wandb"):
        out.append("warning: --use-wandb: wandb is not installed (pip install wandb); metrics go to metrics.jsonl only")
    if args.use_tensorboard and not _installed("tensorboard"):
        out.append("warning: --use-tensorboard: tensorboard is not installed (pip install tensorboard); "
                   "metrics go to metrics.jsonl only")
    return out


def tensorboard_dir(args: Any) -> str:
    return args.tensorboard_dir or os.path.join(args.output_dir, "tensorboard", args.tb_project_name or "",
                                                args.tb_experiment_name or "")


class Tracker:
    """Forwards each metrics record to the trackers that are enabled and installed."""

    def __init__(self, args: Any) -> None:
        self.wandb = self.tb = None  # a missing package was named by train.py's start-up warnings
        # --wandb-always-use-train-step: step records by optimizer steps (samples per rollout / global batch)
        self._steps_per_rollout = None
        if args.wandb_always_use_train_step:
            self._steps_per_rollout = (args.rollout_batch_size * args.n_samples_per_prompt, args.global_batch_size)
        if args.use_wandb and _installed("wandb"):
            import wandb

            if args.wandb_key:
                wandb.login(key=args.wandb_key, host=args.wandb_host)
            group = args.wandb_group
            if group and args.wandb_random_suffix:  # upstream's: a random suffix unless --disable-wandb-random-suffix
                group = f"{group}_{wandb.util.generate_id()}"
            self.wandb = wandb.init(project=args.wandb_project, group=group, name=group, entity=args.wandb_team,
                                    id=args.wandb_run_id, mode=args.wandb_mode, dir=args.wandb_dir,
                                    resume="allow", config={k: v for k, v in vars(args).items()
                                                            if isinstance(v, (int, float, str, bool, type(None)))})
        if args.use_tensorboard and _installed("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir(args))

    def step_of(self, rollouts_done: int) -> int:
        """The tracker step of a record made after `rollouts_done` rollouts."""
        if self._steps_per_rollout is None:
            return rollouts_done
        samples, batch = self._steps_per_rollout
        return rollouts_done * samples // batch

    def log(self, record: dict[str, Any], step: int) -> None:
        step = self.step_of(step)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("rollout_id", "kind")}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
