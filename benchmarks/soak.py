"""Soak under faults: the CPU quick start (tiny GLM-5, colocated trainer + embedded engine, IPC weight sync) for
N rollouts with the engine SIGKILLed every K rollouts and the driver stopped once with SIGTERM and re-run (it
resumes from its last checkpoint), against an unfaulted run of the same seed. Not part of the test suite.

    python benchmarks/soak.py                        # 200 rollouts, engine kill every 40, SIGTERM at 100
    python benchmarks/soak.py --rollouts 24 --kill-every 8 --save-interval 4 --out /tmp/soak

Checks (printed, and written to OUT/soak.json): rollout ids contiguous with no duplicate; rewards equal to the
unfaulted run's (exactly: both runs use SLIME_CPU_THREADS=1); the driver's and the trainer's RSS growth between
rollout `--rss-from` (default 50, or a quarter of the run) and the end, within one process (< 5%; for the
resumed process from `--rss-from` rollouts after its start); no
/dev/shm file of any process of the runs left; exit 143 on the SIGTERM.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assets(out: str) -> tuple[str, str]:
    from slime.rollout.synthetic import make_dataset
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    model = os.path.join(out, "model")
    if not os.path.isfile(os.path.join(model, "config.json")):
        write_tiny_checkpoint(model)
    data = os.path.join(out, "data.jsonl")
    if not os.path.isfile(data):
        with open(data, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in make_dataset(1024, seed=0))
    return model, data


def _argv(a, model: str, data: str, run_dir: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--hf-checkpoint", model, "--prompt-data", data,
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "synthetic",
            "--rollout-shuffle", "--rollout-seed", str(a.seed), "--colocate", "--num-rollout", str(a.rollouts),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
            "--global-batch-size", "8", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--lr", "5e-3",
            "--save", os.path.join(run_dir, "ckpt"), "--load", os.path.join(run_dir, "ckpt"),
            "--save-interval", str(a.save_interval), "--output-dir", os.path.join(run_dir, "run"),
            "--num-cpus", str(os.cpu_count() or 2)]


def _records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "run", "metrics.jsonl")
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip() and '"kind"' not in x]
    except (OSError, ValueError):
        return []


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _find(pid: int, needle: str):
    for p in _descendants(pid):
        try:
            if needle in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def _rss(p) -> int | None:
    try:
        return p.memory_info().rss
    except (psutil.Error, AttributeError):
        return None


class Segment:
    """One train.py process: its records as they appear, faults injected, RSS sampled per record."""

    def __init__(self, a, argv, run_dir: str, faults: bool, sigterm_at: int | None) -> None:
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_CPU_THREADS="1")
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.a, self.run_dir, self.faults, self.sigterm_at = a, run_dir, faults, sigterm_at
        self.kills, self.rss, self.pids, self.stopped = [], {}, set(), False

    def run(self, killed_at: set[int]) -> int:
        seen = len(_records(self.run_dir))
        while self.proc.poll() is None:
            for p in _descendants(self.proc.pid):
                self.pids.add(p.pid)
            records = _records(self.run_dir)
            if len(records) > seen:
                seen = len(records)
                last = records[-1]["rollout_id"]
                trainer = _find(self.proc.pid, "MegatronTrainRayActor")
                self.rss[last] = {"driver": _rss(psutil.Process(self.proc.pid)), "trainer": _rss(trainer)}
                if self.faults and (last + 1) % self.a.kill_every == 0 and last not in killed_at \
                        and last + 1 < self.a.rollouts:
                    engine = _find(self.proc.pid, "slime.backends.embedded")
                    if engine is not None:
                        engine.kill()
                        killed_at.add(last)
                        self.kills.append(last)
                if self.sigterm_at is not None and last + 1 >= self.sigterm_at and not self.stopped:
                    self.proc.send_signal(signal.SIGTERM)
                    self.stopped = True
            time.sleep(0.05)
        self.output = self.proc.stdout.read()
        return self.proc.returncode


def _growth(rss: dict[int, dict], start: int, key: str) -> float | None:
    ids = sorted(i for i in rss if i >= start and rss[i][key])
    if len(ids) < 2:
        return None
    return rss[ids[-1]][key] / rss[ids[0]][key] - 1.0


def _shm_left(pids: set[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/torch_{pid}_*")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/soak.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--kill-every", type=int, default=40)
    ap.add_argument("--sigterm-at", type=int, default=None, help="default: half the rollouts")
    ap.add_argument("--save-interval", type=int, default=20)
    ap.add_argument("--rss-from", type=int, default=None, help="default: 50, or a quarter of a shorter run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "soak"))
    a = ap.parse_args(argv)
    sigterm_at = a.sigterm_at or a.rollouts // 2
    rss_from = a.rss_from if a.rss_from is not None else min(50, a.rollouts // 4)
    os.makedirs(a.out, exist_ok=True)
    model, data = _assets(a.out)
    shm_before = set(glob.glob("/dev/shm/*"))
    t0 = time.time()

    ref_dir = os.path.join(a.out, "unfaulted")
    ref = Segment(a, _argv(a, model, data, ref_dir), ref_dir, faults=False, sigterm_at=None)
    ref_rc = ref.run(set())
    t_ref = time.time() - t0

    faulted_dir = os.path.join(a.out, "faulted")
    killed: set[int] = set()
    first = Segment(a, _argv(a, model, data, faulted_dir), faulted_dir, faults=True, sigterm_at=sigterm_at)
    first_rc = first.run(killed)
    second = Segment(a, _argv(a, model, data, faulted_dir), faulted_dir, faults=True, sigterm_at=None)
    second_rc = second.run(killed)
    t_total = time.time() - t0

    resumed_from = min(second.rss) if second.rss else 0
    ids = [r["rollout_id"] for r in _records(faulted_dir)]
    ref_rewards = {r["rollout_id"]: r["rollout/reward_mean"] for r in _records(ref_dir)}
    rewards = {r["rollout_id"]: r["rollout/reward_mean"] for r in _records(faulted_dir)}
    diff = max((abs(rewards[i] - ref_rewards[i]) for i in rewards if i in ref_rewards), default=float("nan"))
    restarts = sum(r.get("rollout/engine_restarts", 0) for r in _records(faulted_dir))
    pids = ref.pids | first.pids | second.pids
    summary = {
        "rollouts": a.rollouts, "kill_every": a.kill_every, "sigterm_at": sigterm_at, "save_interval": a.save_interval,
        "exit_codes": {"unfaulted": ref_rc, "faulted_until_sigterm": first_rc, "faulted_resumed": second_rc},
        "engine_kills_at": sorted(killed), "engine_restarts_recorded": restarts,
        "ids_contiguous_no_duplicate": ids == list(range(a.rollouts)),
        "rewards_equal_unfaulted": len(rewards) == len(ref_rewards) == a.rollouts and diff == 0.0,
        "reward_max_abs_diff": diff,
        "rss_from_rollout": rss_from,
        "rss_growth": {"unfaulted_driver": _growth(ref.rss, rss_from, "driver"),
                       "unfaulted_trainer": _growth(ref.rss, rss_from, "trainer"),
                       # the resumed process: from --rss-from rollouts after its start (allocator warm-up first)
                       "resumed_driver": _growth(second.rss, resumed_from + rss_from, "driver"),
                       "resumed_trainer": _growth(second.rss, resumed_from + rss_from, "trainer")},
        "resumed_from_rollout": resumed_from,
        "rss_bytes": {"unfaulted": ref.rss, "faulted": first.rss, "resumed": second.rss},
        "shm_files_of_the_runs_left": _shm_left(pids),
        "dev_shm_new_files": sorted(set(glob.glob("/dev/shm/*")) - shm_before),
        "wall_s": {"unfaulted": round(t_ref, 1), "total": round(t_total, 1)},
    }
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    growth_ok = all(g is None or g < 0.05 for g in summary["rss_growth"].values())
    ok = (ref_rc == 0 and first_rc == 143 and second_rc == 0 and summary["ids_contiguous_no_duplicate"]
          and summary["rewards_equal_unfaulted"] and growth_ok and not summary["shm_files_of_the_runs_left"])
    if not ok:
        print("soak: FAILED (see above)", file=sys.stderr)
        for seg in (ref, first, second):
            print(seg.output[-2000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
