"""Run-level reliability on CPU, through the real entry points (train.py and the quick-start script):

- the rollout engine process is SIGKILLed during a rollout: the engine is restarted, gets the trainer's
  current weights through the weight sync (checksum-verified), the lost samples are generated again,
  the run finishes every rollout and metrics.jsonl records the restart;
- the quick start run twice: the second run resumes from the first's checkpoint (says so) and no metrics
  record is lost; a run dir with metrics but no checkpoint is refused with one line;
- the engine dies again beyond --rollout-engine-max-restarts: the run stops with one line and the
  engine's log tail (exit 1), nothing left running;
- Ctrl-C (SIGINT to the process group, as a terminal sends it): exit 130 with one line, no process of the
  run left, no shared-memory file of its trainer ranks left in /dev/shm.

Sizes are tiny (2-3 rollouts of 2 prompts x 4 samples).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

from slime.rollout.sglang_router import router_available  # noqa: E402
from slime.utils.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
         "--global-batch-size", "8", "--max-tokens-per-gpu", "1024", "--save-interval", "100"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_VENV=sys.prefix)
    env.pop("RAY_ADDRESS", None)
    return env


def _quick_start(run_dir, num_rollout: int, *extra: str, **popen) -> subprocess.Popen:
    # WARMUP_STEPS=0: the random-init checkpoint (the warm-up's seconds buy nothing these tests check)
    env = dict(_env(), RUN_DIR=str(run_dir), NUM_ROLLOUT=str(num_rollout), WARMUP_STEPS="0")
    # The quick start's own routing: through the real sglang-router when it is installed (as in CI)
    return subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "run-glm5.3-flash-tiny-cpu.sh"), *SMALL, *extra],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _records(run_dir) -> list[dict]:
    try:
        return read_metrics(os.path.join(run_dir, "run"))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _wait_for_records(proc, run_dir, n: int, timeout: float = 400.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_records(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no metrics record in time"
        time.sleep(0.1)


def _descendants(proc) -> list:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _engine_process(proc):
    for p in _descendants(proc):
        try:
            if "slime.backends.embedded" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def _trainer_pids(procs) -> list[int]:
    out = []
    for p in procs:
        try:
            if "MegatronTrainRayActor" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def _gone(procs, timeout: float = 60.0) -> list:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


@pytest.fixture(scope="module")
def quick_start_inputs(tmp_path_factory):
    """model/, data.jsonl and eval.jsonl as the quick start writes them (same functions and arguments), once:
    the runs below that test how a run ends start from a copy (the script skips inputs that exist);
    quick_run writes its own through the script."""
    from slime.rollout import synthetic
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("inputs")
    write_tiny_checkpoint(str(d / "model"), "glm5_next", 0)
    task = ["--tasks", "answer", "--min-len", "2", "--max-len", "4"]
    synthetic.main(["--out", str(d / "eval.jsonl"), "--num", "32", "--seed", "1", *task])
    synthetic.main(["--out", str(d / "data.jsonl"), "--num", "4096", "--seed", "0", *task,
                    "--exclude", str(d / "eval.jsonl")])
    return d


def _with_inputs(inputs, run_dir):
    shutil.copytree(inputs / "model", run_dir / "model")
    for name in ("data.jsonl", "eval.jsonl"):
        shutil.copy(inputs / name, run_dir / name)
    return run_dir


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Quick start, 2 rollouts; the engine is killed as soon as rollout 0 is recorded (rollout 1 is then
    generating)."""
    run_dir = tmp_path_factory.mktemp("quick")
    # longer responses than the other runs: rollout 1's generation lasts long enough to be hit by the kill
    proc = _quick_start(run_dir, 2, "--rollout-max-response-len", "24")
    _wait_for_records(proc, run_dir, 1)
    engine = _engine_process(proc)
    assert engine is not None, "no embedded engine process under the run"
    pids = [p for p in _descendants(proc)]
    engine.kill()
    out, err = proc.communicate(timeout=500)
    return {"dir": run_dir, "rc": proc.returncode, "out": out, "err": err, "procs": pids, "killed": engine.pid}


def test_engine_killed_mid_rollout_run_finishes_with_trainer_weights(quick_run):
    assert quick_run["rc"] == 0, quick_run["err"][-3000:]
    records = _records(quick_run["dir"])
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert sum(r["rollout/engine_restarts"] for r in records) == 1
    restarted = records[1]
    if router_available():
        assert "rollout requests go through sglang-router" in quick_run["err"]
    assert restarted["rollout/engine_restarts"] == 1 and restarted["rollout/engine_restart_seconds"] > 0
    assert restarted["rollout/samples"] == 8
    if restarted["rollout/engine_resyncs"] == 1:
        # restarted during rollout 1's generation: re-synced with the trainer's weights before serving again,
        # checksum-verified (a mismatch fails the run), and its lost requests re-issued
        assert "re-synced to the trainer's weights" in quick_run["err"]
        assert restarted["rollout/reissued_requests"] >= 1
    else:  # the kill landed after generation: restarted before the weight sync, which gave it the weights
        assert restarted["rollout/engine_resyncs"] == 0 and "re-synced" not in quick_run["err"]
    assert all(r["weight_sync/checked_tensors"] > 0 for r in records)  # every sync checksum-verified


def test_finished_run_leaves_no_process_or_shared_memory(quick_run):
    assert not _gone(quick_run["procs"])
    for pid in _trainer_pids(quick_run["procs"]) or []:
        assert not glob.glob(f"/dev/shm/torch_{pid}_*")


def test_quick_start_again_resumes_and_keeps_metrics(quick_run):
    before = _records(quick_run["dir"])
    proc = _quick_start(quick_run["dir"], 3)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-3000:]
    assert f"resuming from {quick_run['dir']}/ckpt after rollout 1" in out
    records = _records(quick_run["dir"])
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert records[:2] == before  # the first run's records are kept as they were


def test_run_dir_with_metrics_but_no_checkpoint_is_refused(tmp_path, quick_start_inputs):
    _with_inputs(quick_start_inputs, tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0}) + "\n")
    proc = _quick_start(tmp_path, 2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    lines = [x for x in err.splitlines() if x.strip() and "Writing model shards" not in x]
    assert len(lines) == 1 and "metrics.jsonl" in lines[0] and "--overwrite-output" in lines[0], err
    assert not (tmp_path / "ckpt").exists()


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path, quick_start_inputs):
    _with_inputs(quick_start_inputs, tmp_path)
    proc = _quick_start(tmp_path, 50, start_new_session=True)
    _wait_for_records(proc, tmp_path, 1)
    procs = _descendants(proc)
    trainers = _trainer_pids(procs)
    assert trainers and glob.glob(f"/dev/shm/torch_{trainers[0]}_*")  # the weight-sync buffers exist now
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("train.py: SIGINT"), err[-2000:]
    assert not _gone(procs)
    for pid in trainers:
        assert not glob.glob(f"/dev/shm/torch_{pid}_*")


def test_engine_death_beyond_the_restart_bound_stops_with_its_log_tail(tmp_path, quick_start_inputs):
    _with_inputs(quick_start_inputs, tmp_path)
    proc = _quick_start(tmp_path, 3, "--rollout-engine-max-restarts", "0")
    _wait_for_records(proc, tmp_path, 1)
    engine = _engine_process(proc)
    assert engine is not None
    procs = _descendants(proc)
    engine.kill()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "restarts are used up" in errors[0] and "killed by signal 9" in errors[0], err[-3000:]
    lines = err.splitlines()
    after = lines[lines.index(errors[0]) + 1:]  # Ray's forwarded worker lines may interleave later on
    assert after and after[0].startswith("  | "), err[-3000:]  # the engine's log tail follows the one line
    assert len(_records(tmp_path)) == 1
    assert not _gone(procs)
