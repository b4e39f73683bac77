"""Which run an output dir belongs to, so that re-running the same command continues it.

`OUTPUT_DIR/run.json` (written atomically when a run starts, before Ray) holds the run id, a hash of the
flags that define the run (model, data, checkpoint dirs, seeds, batch shape, estimator, learning rate;
not --num-rollout, which a re-run may raise), and the pids of the processes the run started that leave
host-wide state behind when they are killed (trainer ranks: shared-memory files), each with its start
time so that a recycled pid is never mistaken for it.

Re-running the same command:
- with a checkpoint in --load: resumes after it (the records after it are dropped, `MetricsLogger`);
- before the first checkpoint: restarts from rollout 0; the records of the unsaved rollouts are discarded
  and a line says so (`discard_unsaved_records`);
- another run's output dir (another id, or no run.json) is still refused (`slime.config.preflight`).
At start, the shared memory of dead trainer ranks of an earlier run of the same dir is removed, and the
agents and workers of its dead Ray session stopped (`release_stale_memory`): a driver killed with SIGKILL
cannot clean up itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

RUN_FILE = "run.json"
# The flags that make two commands the same run (paths compared by their real path).
IDENTITY_FLAGS = ("hf_checkpoint", "prompt_data", "load", "save", "output_dir", "seed", "rollout_seed",
                  "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "advantage_estimator", "lr")
_PATH_FLAGS = ("hf_checkpoint", "prompt_data", "load", "save", "output_dir")


def run_id(args: Any) -> str:
    ident = {}
    for flag in IDENTITY_FLAGS:
        value = getattr(args, flag)
        if flag in _PATH_FLAGS and value:
            value = os.path.realpath(value)
        ident[flag] = value
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_run(output_dir: str | None) -> dict[str, Any] | None:
    path = os.path.join(output_dir, RUN_FILE) if output_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: treated as another run's dir
    return data if isinstance(data, dict) else None


def same_run(args: Any) -> bool:
    """Whether OUTPUT_DIR/run.json was written by this command (same run id)."""
    found = read_run(args.output_dir)
    return found is not None and found.get("run_id") == run_id(args)


def _write(output_dir: str, data: dict[str, Any]) -> None:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RUN_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _process_start_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # gone, or no access
        return None


def start_run(args: Any) -> None:
    """Write run.json for this command (keeps the process records of an earlier run of the same dir until
    they are released)."""
    previous = read_run(args.output_dir) or {}
    data = {"run_id": run_id(args), "processes": previous.get("processes", [])}
    _write(args.output_dir, data)


def record_processes(output_dir: str, pids: list[int], role: str, **extra: Any) -> None:
    """Remember processes whose host-wide state must be released if the run is killed (SIGKILL): trainer ranks
    (shared memory) and the local Ray session's raylet (`node_id`: its agents and workers are found by it)."""
    data = read_run(output_dir) or {}
    known = data.setdefault("processes", [])
    for pid in pids:
        known.append({"pid": int(pid), "role": role, "start_time": _process_start_time(int(pid)), **extra})
    _write(output_dir, data)


def _alive(entry: dict[str, Any]) -> bool:
    start = _process_start_time(int(entry["pid"]))
    return start is not None and (entry.get("start_time") is None or abs(start - entry["start_time"]) < 1.0)


def release_stale_memory(output_dir: str | None) -> int:
    """Free the host-wide IPC memory (on CPU /dev/shm/torch_<pid>_*) of recorded processes that are dead
    (an earlier run of this dir killed without cleanup), and stop what is left of that run's Ray session
    when its raylet is dead; returns how many segments were freed. Live ones (another run still going) are
    kept."""
    data = read_run(output_dir)
    if not data or not data.get("processes"):
        return 0
    from slime.accelerator import get_accelerator
    from slime.utils.exits import kill_session_processes

    dead = [e for e in data["processes"] if not _alive(e)]
    for e in dead:  # a dead raylet's agents and workers outlive it by up to a minute: stop them first
        if e.get("role") == "raylet" and e.get("node_id"):
            kill_session_processes(int(e["pid"]), grace_s=2.0, node_id=e["node_id"])
    dead_ranks = [int(e["pid"]) for e in dead if e.get("role") != "raylet"]
    freed = get_accelerator().release_ipc_memory(dead_ranks) if dead_ranks else 0
    data["processes"] = [e for e in data["processes"] if e not in dead]
    _write(output_dir, data)  # type: ignore[arg-type]
    return freed


def discard_unsaved_records(output_dir: str, metrics_file: str = "metrics.jsonl") -> int:
    """Restart before the first checkpoint: the records of rollouts that no checkpoint holds are removed
    (temp file, then rename); returns how many."""
    path = os.path.join(output_dir, metrics_file)
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        count = sum(1 for line in f if line.strip())
    tmp = f"{path}.tmp.{os.getpid()}"
    open(tmp, "w").close()
    os.replace(tmp, path)
    return count
