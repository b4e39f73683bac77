"""train_async.py's one-step-off-policy loop on CPU: the tiny GLM-5 quick start, one engine on its own device,
4 iterations. Rollout k+1 is generated while rollout k trains (wall-clock bounds in metrics.jsonl overlap), with
the weights synced after rollout k-1 (version k); the trainer trains it from version k+1. The runs call the loop
in this process (slime.train_async.train, as train_async.py's main does after its checks), one Ray session for
all of them; train_async.py itself: --dry-run works, --colocate is refused (and tests/test_sft.py runs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from logged_run import run_failure, run_logged
from test_e2e import ROOT, _argv, assets  # noqa: F401 - the quick start's tiny model and data

from slime.utils.metrics import REQUIRED_KEYS, read_metrics

pytestmark = pytest.mark.timeout(420)
ON_VERSION_BOUND = 1e-3  # float32 trainer vs float32 engine, same weights (as tests/test_e2e.py)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from slime.ray.placement_group import init_ray

    os.environ.setdefault("SLIME_CPU_THREADS", "1")  # as the quick start's runs here: one thread per process
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _train(argv: list[str]) -> list[dict]:
    """One run of train_async.py's loop in this process (its Ray session: ray_session)."""
    from slime.config.arguments import parse_args
    from slime.train_async import train

    return train(parse_args(argv))


def _run(*argv: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_CPU_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    return run_logged([sys.executable, os.path.join(ROOT, "train_async.py"), *argv], env=env, cwd=ROOT,
                      timeout=timeout)


# (lr, --update-weights-interval, engine version of each rollout's generation, weight syncs after rollout k,
#  --keep-old-actor)
CASES = [("5e-3", 1, [0, 0, 1, 2], {0: 1, 1: 2, 2: 3, 3: 4}, False), ("0", 2, [0, 0, 0, 2], {1: 2, 3: 4}, False),
         ("5e-3", 1, [0, 0, 1, 2], {0: 1, 1: 2, 2: 3, 3: 4}, True)]


@pytest.mark.parametrize("lr, interval, generated_with, synced, keep_old_actor", CASES)
def test_one_step_off_policy(assets, ray_session, tmp_path, lr, interval, generated_with, synced,  # noqa: F811
                             keep_old_actor):
    """lr 0: every version holds the same weights, so each rollout's engine log-probs must agree with the
    trainer's (the payloads pair up with their versions); lr 5e-3: rollout k >= 1 drifts by one step, unless
    --keep-old-actor: the old log-probs then come from the weights that generated the rollout, and agree."""
    out = str(tmp_path / "run")
    returned = _train([*_argv(assets, out, "--rollout-num-gpus", "1", "--update-weight-mode", "distributed",
                              "--num-rollout", "4"), "--lr", lr, "--update-weights-interval", str(interval),
                       "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                       *(["--keep-old-actor"] if keep_old_actor else [])])
    records = read_metrics(out)
    assert records == json.loads(json.dumps(returned))  # the file holds what the loop returned
    assert [r["rollout_id"] for r in records] == [0, 1, 2, 3]
    for k, r in enumerate(records):
        assert not [key for key in REQUIRED_KEYS if key not in r]
        assert r["rollout/start_time"] < r["rollout/end_time"] <= r["train/start_time"] < r["train/end_time"]
        assert r["rollout/weight_version"] == generated_with[k] and r["train/weight_version"] == k
        assert r.get("weight_sync/version") == synced.get(k) and (k not in synced or r["weight_sync/checked_tensors"] > 0)
    for prev, nxt in zip(records, records[1:]):  # generation k+1 runs while k trains
        assert nxt["rollout/start_time"] < prev["train/end_time"] and nxt["rollout/end_time"] > prev["train/start_time"]
        assert nxt["rollout/start_time"] >= prev["rollout/end_time"]  # one generation at a time
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000001", "iter_0000003", "latest_checkpointed_iteration.txt"]
    dlp = [r["train_rollout_logprob_abs_diff"] for r in records]
    assert dlp[0] < ON_VERSION_BOUND, dlp  # generated and trained on version 0
    if float(lr) == 0 or keep_old_actor:  # agreement per weight version
        assert max(dlp) < ON_VERSION_BOUND, dlp
        return
    assert min(dlp[1:]) > 10 * ON_VERSION_BOUND, dlp  # trained from version k, generated with k - 1
    # resume from the checkpoint after rollout 1 (version 2): rollout 2 is generated again, on version 2
    shutil.copytree(tmp_path / "ckpt" / "iter_0000001", tmp_path / "resume" / "iter_0000001")
    (tmp_path / "resume" / "latest_checkpointed_iteration.txt").write_text("1")
    _train([*_argv(assets, str(tmp_path / "resumed"), "--rollout-num-gpus", "1", "--update-weight-mode",
                   "distributed", "--num-rollout", "4"), "--lr", lr, "--load", str(tmp_path / "resume")])
    resumed = read_metrics(str(tmp_path / "resumed"))
    assert [(r["rollout_id"], r["rollout/weight_version"], r["train/weight_version"]) for r in resumed] == [
        (2, 2, 2), (2 + 1, 2, 3)]
    assert resumed[0]["train_rollout_logprob_abs_diff"] < ON_VERSION_BOUND  # generated and trained on version 2


def test_dry_run_and_colocate_refused(assets, tmp_path):  # noqa: F811
    proc = _run(*_argv(assets, str(tmp_path / "dry"), "--rollout-num-gpus", "1", "--num-rollout", "4", "--dry-run"),
                timeout=120)
    assert proc.returncode == 0 and "would fail" not in proc.stdout + proc.stderr, run_failure(proc)
    proc = _run(*_argv(assets, str(tmp_path / "co"), "--colocate", "--num-rollout", "4"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "train_async.py: error: --colocate is not supported: the engines generate while the trainer trains, so they "
        "need devices of their own; pass --rollout-num-gpus N (or use train.py)"], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "co")
