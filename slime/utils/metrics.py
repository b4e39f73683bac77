"""Per-iteration metrics: one compact console line and one JSON object per line in metrics.jsonl.
Evaluation records share the file, marked `"kind": "eval"` (iteration records carry no kind)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"

# Keys every iteration record carries (the e2e test checks them).
REQUIRED_KEYS = (
    "rollout_id", "rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean",
    "train/kl", "train/entropy", "train/clip_frac", "train/grad_norm", "train/loss",
    "train_rollout_logprob_abs_diff", "time/rollout", "time/log_probs", "time/train", "time/weight_sync",
    "time/save", "time/iteration", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
    "memory/train_peak_bytes",
)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n:.1f}T"


CONSOLE_WIDTH = 120


def console_line(m: dict[str, Any], num_rollout: int) -> str:
    """One line per rollout, at most CONSOLE_WIDTH columns (the other phases' seconds, grad norm, clip fraction,
    throughput and memory are in metrics.jsonl and the report). The rollout
    id counts from 0, as in metrics.jsonl, checkpoints and reports: `[rollout 4/9]` is id 4 of ids 0..9.
    When long values do not fit, whole fields are left out (least useful first), never a number cut."""
    g = m.get
    width = len(str(max(num_rollout - 1, 0)))
    head = (f"[rollout {m['rollout_id']:>{width}}/{num_rollout - 1}] reward {g('rollout/reward_mean', math.nan):.3f}"
            f"±{g('rollout/reward_std', math.nan):.3f}")
    # (text, drop order: higher goes first); the groups are joined with " | "
    train = [(f"loss {g('train/loss', math.nan):+.3f}", 2), (f"kl {g('train/kl', math.nan):.0e}", 7),
             (f"ent {g('train/entropy', math.nan):.2f}", 5), (f"dlp {g('train_rollout_logprob_abs_diff', math.nan):.0e}", 8)]
    if "train/loss" not in m:  # --debug-rollout-only: nothing trained
        train = []
    times = [(f"{g('time/iteration', 0):.1f}s:", 1), (f"roll {g('time/rollout', 0):.1f}", 3),
             (f"train {g('time/train', 0):.1f}", 3)]
    if g("time/save", 0) >= 0.05:
        times.append((f"save {g('time/save', 0):.1f}", 4))
    groups = [[(f"len {g('rollout/response_len_mean', math.nan):.1f}", 6)], train, times]
    if g("rollout/engine_restarts", 0):
        groups.append([(f"restarts {int(g('rollout/engine_restarts'))}", 0)])

    def render() -> str:
        parts = [" ".join(t for t, _ in grp) for grp in groups if grp]
        first = head + (" " + parts[0] if parts and groups[0] else "")
        rest = parts[1:] if groups[0] else parts
        return " | ".join([first, *rest])

    line = render()
    while len(line) > CONSOLE_WIDTH:
        fields = [(rank, gi, fi) for gi, grp in enumerate(groups) for fi, (_, rank) in enumerate(grp) if rank > 0]
        if not fields:
            return line[:CONSOLE_WIDTH]  # only the head and the restart count are left: cannot happen below ~1e90
        _, gi, fi = max(fields)
        del groups[gi][fi]
        line = render()
    return line


def eval_console_line(r: dict[str, Any]) -> str:
    names = sorted({k.split("/")[1] for k in r if k.startswith("eval/")})
    parts = [f"{n} reward {r[f'eval/{n}/reward_mean']:.3f}±{r[f'eval/{n}/reward_std']:.3f} "
             f"len {r[f'eval/{n}/response_len_mean']:.1f} ({r[f'eval/{n}/samples']:.0f} samples)" for n in names]
    return f"[eval after {r['eval_step']} rollouts] " + " | ".join(parts)


class MetricsLogger:
    def __init__(self, output_dir: str, resume_from: int | None = None) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, METRICS_FILE)
        if resume_from is not None and os.path.exists(self.path):
            # Drop records of iterations that will run again (written after the checkpoint we resume from).
            kept = [r for r in _read_records(self.path) if r["rollout_id"] < resume_from]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        elif resume_from is None and os.path.exists(self.path):
            os.remove(self.path)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
            f.flush()


def _read_records(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(output_dir: str, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one kind: "train" (one per iteration) or "eval" (one per evaluation)."""
    path = os.path.join(output_dir, METRICS_FILE) if os.path.isdir(output_dir) else output_dir
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {output_dir}; pass the --output-dir of a run")
    return [r for r in _read_records(path) if r.get("kind", "train") == kind]
