"""SIGTERM (what `timeout`, `docker stop`, Slurm and Kubernetes send) at every stage of a run, through train.py:
exit 143, one line, no traceback, no process of the run left, no shared-memory file of its trainer ranks left,
and a checkpoint being written when the signal arrives is either completed or not published.

Three processes share the stages (each run of Ray costs tens of seconds on 2 cores):
- before Ray: preflight blocked reading --prompt-data (a FIFO), SIGTERM to the driver: nothing written;
- mid-run, during a save: SIGTERM to the driver alone (`docker stop`, `kill PID`) while rollout 1's checkpoint
  is being written (rollout 0's record exists, no checkpoint before it);
- the same command again (run identity: it restarts before the first checkpoint, or resumes from a completed
  one) and SIGTERM to the whole process group (`timeout`, `kill -TERM -PGID`) during its start-up, which also
  stops Ray's own GCS and raylet.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTHING_LEFT_S = 30.0  # every process of the run gone within this after the driver exits


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from glm5_helpers import write_run_inputs

    return write_run_inputs(tmp_path_factory.mktemp("signals"), 32, (5, 5))


def _argv(assets, run_dir, prompt_data: str | None = None, *extra: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--hf-checkpoint", assets["model"],
            "--prompt-data", prompt_data or assets["data"], "--apply-chat-template", "--rm-type", "synthetic",
            "--colocate",  # as the quick start: IPC weight sync through shared memory
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--global-batch-size", "8", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
            "--num-cpus", "2", "--num-rollout", "50", "--output-dir", str(run_dir / "run"),
            "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), "--save-interval", "2", *extra]


_started: list[subprocess.Popen] = []


@pytest.fixture(scope="module", autouse=True)
def _stop_leftovers():
    """A failed assertion must not leave a run going."""
    yield
    for proc in _started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _start(argv) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as under `timeout` or a shell job
    _started.append(proc)
    return proc


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


class Watch:
    """Every process of the run seen while it runs (the descendants of the driver)."""

    def __init__(self, proc) -> None:
        self.proc, self.seen = proc, {}

    def poll(self) -> list:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for k in kids:
            self.seen.setdefault(k.pid, k)
        return kids

    def wait_for(self, cond, what: str, timeout: float = 400.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond(self.poll()):
            assert self.proc.poll() is None, f"exited before {what}: " + self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {what} in time"
            time.sleep(0.01)

    def trainer_pids(self) -> list[int]:
        return [pid for pid, p in self.seen.items() if "MegatronTrainRayActor" in _cmdline(p)]


def _assert_clean_stop(proc, watch: Watch, trainers: list[int]) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("train.py: SIGTERM: stopped") and last.endswith("exit 143"), err[-2000:]
    _, alive = psutil.wait_procs(list(watch.seen.values()), timeout=NOTHING_LEFT_S)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [_cmdline(p) for p in alive]
    for pid in trainers:
        assert not glob.glob(f"/dev/shm/torch_{pid}_*")
    return out


def test_sigterm_in_preflight_exits_143_and_writes_nothing(assets, tmp_path):
    fifo = str(tmp_path / "prompts.jsonl")
    os.mkfifo(fifo)  # preflight blocks on it: the signal lands inside preflight
    proc = _start(_argv(assets, tmp_path, fifo))
    deadline = time.monotonic() + 120
    while True:  # a FIFO opens for writing (non-blocking) only once its reader is there
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "train.py never opened --prompt-data"
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            time.sleep(0.05)
    try:  # the writer stays open (and silent), so the read blocks: closing it would hand train.py an empty file
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(writer)
    assert proc.returncode == 143, err[-2000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == ["train.py: SIGTERM: stopped; exit 143"], err[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["prompts.jsonl"]  # no run dir, no checkpoint dir


@pytest.fixture(scope="module")
def stopped_during_save(assets, tmp_path_factory):
    """SIGTERM to the driver alone while rollout 1's checkpoint is being written."""
    run_dir = tmp_path_factory.mktemp("save")
    proc = _start(_argv(assets, run_dir))
    watch = Watch(proc)
    watch.wait_for(lambda _: glob.glob(str(run_dir / "ckpt" / ".tmp_iter_*")), "checkpoint being written")
    trainers = watch.trainer_pids()
    assert trainers and glob.glob(f"/dev/shm/torch_{trainers[0]}_*")  # the weight-sync buffers exist now
    proc.send_signal(signal.SIGTERM)
    return {"dir": run_dir, "out": _assert_clean_stop(proc, watch, trainers)}


def test_sigterm_during_a_save_exits_143_and_publishes_only_whole_checkpoints(stopped_during_save):
    from slime.config.preflight import check_torch_dist

    ckpt = stopped_during_save["dir"] / "ckpt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if tracker.exists():  # the save had finished: the tracker names it and it is intact
        assert tracker.read_text().strip() == "1"
        check_torch_dist(str(ckpt / "iter_0000001"))
    else:  # cut: not published (only the temp dir, which the next save replaces)
        assert not glob.glob(str(ckpt / "iter_*"))
    records = [json.loads(x) for x in (stopped_during_save["dir"] / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0]


def test_same_command_again_continues_the_run_and_sigterm_to_the_group_in_start_up(assets, stopped_during_save):
    run_dir = stopped_during_save["dir"]
    published = (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    proc = _start(_argv(assets, run_dir))
    watch = Watch(proc)
    watch.wait_for(lambda kids: any("MegatronTrainRayActor" in _cmdline(k) for k in kids), "trainer rank")
    os.killpg(proc.pid, signal.SIGTERM)  # the group: the driver and Ray's own GCS, raylet and agents
    out = _assert_clean_stop(proc, watch, watch.trainer_pids())
    if published:
        assert f"resuming from {run_dir / 'ckpt'} after rollout 1" in out, out
    else:  # the same run, stopped before its first checkpoint: restarted, its unsaved record discarded
        assert "restarting from rollout 0" in out and "1 metric record of its unsaved rollouts discarded" in out, out
        assert (run_dir / "run" / "metrics.jsonl").read_text() == ""
