"""Run identity (OUTPUT_DIR/run.json): the same command re-run before its first checkpoint restarts (its
unsaved records discarded, said so), another run's dir is still refused; what a killed earlier run of the dir
left (trainer shared memory, its Ray session's agents) is released at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slime.config.arguments import parse_args
from slime.config.preflight import PreflightError, run_preflight
from slime.utils import run_identity


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from glm5_helpers import write_run_inputs

    return write_run_inputs(tmp_path_factory.mktemp("identity"), 8, (5, 5))


def _args(assets, out, *extra):
    return parse_args(["--hf-checkpoint", assets["model"], "--prompt-data", assets["data"], "--rm-type", "synthetic",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
                       "--num-rollout", "20", "--output-dir", str(out / "run"), "--save", str(out / "ckpt"),
                       "--load", str(out / "ckpt"), *extra])


def test_run_id_follows_the_defining_flags_only(assets, tmp_path):
    base = run_identity.run_id(_args(assets, tmp_path))
    assert run_identity.run_id(_args(assets, tmp_path, "--num-rollout", "60")) == base  # a re-run may extend it
    assert run_identity.run_id(_args(assets, tmp_path, "--seed", "7")) != base
    assert run_identity.run_id(_args(assets, tmp_path, "--lr", "1e-3")) != base


def test_same_command_restarts_before_its_first_checkpoint(assets, tmp_path):
    args = _args(assets, tmp_path)
    run_identity.start_run(args)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"rollout_id": i}) + "\n" for i in range(19)))
    report = run_preflight(_args(assets, tmp_path))
    assert report.restart_records == 19
    assert ("restarting from rollout 0: this run was stopped before its first checkpoint; 19 metric records of its "
            "unsaved rollouts discarded") in report.lines(args)
    assert run_identity.discard_unsaved_records(str(tmp_path / "run")) == 19 and metrics.read_text() == ""


def test_another_runs_dir_is_still_refused(assets, tmp_path):
    run_identity.start_run(_args(assets, tmp_path, "--seed", "7"))
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0}) + "\n")
    with pytest.raises(PreflightError, match="holds another run's metrics.jsonl"):
        run_preflight(_args(assets, tmp_path))
    os.remove(tmp_path / "run" / "run.json")  # no identity at all: refused too
    with pytest.raises(PreflightError, match="--overwrite-output"):
        run_preflight(_args(assets, tmp_path))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_runs_shared_memory_and_ray_agents_are_released(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    run_identity._write(out, {"run_id": "x", "processes": []})
    # a live process: its file stays; a dead trainer rank: its file goes
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = _dead_pid()
    files = {pid: f"/dev/shm/torch_{pid}_slime_test_{os.getpid()}" for pid in (live.pid, dead)}
    for path in files.values():
        open(path, "w").close()
    run_identity.record_processes(out, [live.pid], "trainer")
    data = run_identity.read_run(out)
    data["processes"].append({"pid": dead, "role": "trainer", "start_time": time.time() - 10})
    # a dead raylet whose agent lives on (it carries the session's RAY_NODE_ID)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env=dict(os.environ, RAY_NODE_ID=f"test-node-{os.getpid()}"))
    data["processes"].append({"pid": _dead_pid(), "role": "raylet", "start_time": time.time() - 10,
                              "node_id": f"test-node-{os.getpid()}"})
    run_identity._write(out, data)
    try:
        assert run_identity.release_stale_memory(out) == 1
        assert not os.path.exists(files[dead]) and os.path.exists(files[live.pid])
        assert agent.wait(timeout=10) is not None  # stopped
        assert live.poll() is None
        assert [e["pid"] for e in run_identity.read_run(out)["processes"]] == [live.pid]  # the dead are forgotten
    finally:
        live.kill()
        agent.kill()
        for path in files.values():
            if os.path.exists(path):
                os.remove(path)
