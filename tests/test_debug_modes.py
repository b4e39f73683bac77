"""Upstream's debug split and replay, and --keep-old-actor, on the tiny GLM-5 quick-start model (CPU):

- a run (split placement) saves its rollouts (--save-debug-rollout-data); a run with --load-debug-rollout-data (which
  implies --debug-train-only: no engine, no prompt file) trains on them and reproduces every step's loss, grad
  norm and updated weights bit for bit (torch.equal on every checkpoint tensor);
- --debug-rollout-only starts engines and no trainer rank, and saves rollouts that equal the full run's first one;
- the saved files are plain data, read with weights_only=True: a file with a pickled object is refused, its
  code never runs;
- the full run also has --use-fault-tolerance, and its engine is frozen (SIGSTOP) after rollout 0: the health
  checks find it, kill, restart and re-sync it, and the run (and its replay) finishes;
- --keep-old-actor on one trainer rank (no Ray): the old log-probs are exactly those of upstream's old_actor copy
  (the weights one sync back with --update-weights-interval 1, the last synced ones otherwise), not the current.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(400)

TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/clip_frac", "train/ppo_kl",
              "rollout/reward_mean", "rollout/reward_std", "train/tokens")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from glm5_helpers import write_run_inputs

    return write_run_inputs(tmp_path_factory.mktemp("debug_modes"), 32, (5, 5), eval_prompts=4)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from slime.ray.placement_group import init_ray

    os.environ.setdefault("SLIME_CPU_THREADS", "1")  # identical threads in every run: identical float sums
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _argv(inputs, out, *extra, prompts: bool = True) -> list[str]:
    return ["--hf-checkpoint", inputs["model"], *(["--prompt-data", inputs["data"]] if prompts else []),
            "--apply-chat-template", "--rm-type", "synthetic", "--rollout-shuffle", "--rollout-seed", "3",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "16",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--lr", "5e-3", "--num-cpus", "2",
            "--num-rollout", "2", "--output-dir", str(out), *extra]


def _samples(n: int):
    from slime.utils.types import Sample

    out = []
    for i in range(n):
        s = Sample(index=i, group_index=i // 2, prompt=f"p{i}", tokens=[1, 2, 3 + i, 4], response="x y",
                   response_length=2, label="l", reward={"score": 0.5 * i, "acc": i % 2 == 0}, loss_mask=[1, 0],
                   rollout_log_probs=[-0.25, -1.0 / 3], weight_versions=["3"], metadata={"k": [1, 2]},
                   status=Sample.Status.TRUNCATED)
        s.rollout_routed_experts = np.arange(6, dtype=np.int32).reshape(2, 1, 3)
        out.append(s)
    return out


def test_saved_rollout_is_plain_data_and_reads_back(tmp_path):
    from slime.rollout import debug_data
    from slime.utils.types import Sample

    samples = _samples(5)
    path = debug_data.save_rollout(str(tmp_path / "r" / "{rollout_id}.pt"), samples, 7)
    assert path == str(tmp_path / "r" / "7.pt") and not [p for p in os.listdir(tmp_path / "r") if ".tmp" in p]
    raw = torch.load(path, weights_only=True)  # upstream's layout, loadable without unpickling objects
    assert raw["rollout_id"] == 7 and len(raw["samples"]) == 5 and raw["samples"][0]["status"] == "truncated"
    back = debug_data.load_rollout(str(tmp_path / "r" / "{rollout_id}.pt"), 7)
    for a, b in zip(samples, back):
        da, db = a.to_dict(), b.to_dict()
        assert torch.equal(db.pop("rollout_routed_experts"), torch.from_numpy(da.pop("rollout_routed_experts")))
        assert da == db  # floats exact (-1/3 included), dict reward, status, metadata
    assert back[2].status is Sample.Status.TRUNCATED
    # upstream's subsample: n = int(len * ratio), the first n // 2 and the last n - n // 2
    assert [s.index for s in debug_data.load_rollout(str(tmp_path / "r" / "{rollout_id}.pt"), 7, 0.6)] == [0, 3, 4]
    with pytest.raises(debug_data.DebugDataError, match="keeps no sample"):
        debug_data.load_rollout(str(tmp_path / "r" / "{rollout_id}.pt"), 7, 0.1)
    with pytest.raises(debug_data.DebugDataError, match=r"8\.pt \(rollout 8\) does not exist"):
        debug_data.load_rollout(str(tmp_path / "r" / "{rollout_id}.pt"), 8)


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_with_a_pickled_object_is_refused_without_running_it(tmp_path):
    from slime.rollout import debug_data

    marker = tmp_path / "ran"
    torch.save({"rollout_id": 0, "samples": [{"index": 0, "metadata": _Payload(str(marker))}]}, tmp_path / "0.pt")
    with pytest.raises(debug_data.DebugDataError) as e:
        debug_data.load_rollout(str(tmp_path / "{rollout_id}.pt"), 0)
    assert "not a plain-data rollout file" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    with pytest.raises(debug_data.DebugDataError, match=r"sample 0\['metadata'\]\['o'\] is a object"):
        bad = _samples(1)
        bad[0].metadata = {"o": object()}
        debug_data.save_rollout(str(tmp_path / "{rollout_id}.pt"), bad, 1)


def test_mode_flags(inputs, capsys):
    from slime.config.arguments import parse_args

    base = ["--hf-checkpoint", inputs["model"], "--rollout-batch-size", "2", "--num-rollout", "1"]
    args = parse_args(base + ["--load-debug-rollout-data", "/x/{rollout_id}.pt", "--eval-interval", "1",
                              "--eval-prompt-data", "copy", inputs["eval_data"]])
    assert args.debug_train_only and args.rollout_num_gpus == 0  # upstream: loading implies train-only
    from slime.rollout.evaluation import eval_steps

    assert eval_steps(args, 0) == set()  # no engine to evaluate with (upstream: eval returns at once)
    args = parse_args(base + ["--debug-rollout-only", "--colocate", "--actor-num-gpus-per-node", "2"])
    assert not args.colocate and args.rollout_num_gpus == 2 and not args.offload_train and not args.offload_rollout
    from slime.ray.placement_group import bundle_devices

    assert bundle_devices(args) == ([1, 1], 0)  # the engines' devices only; no trainer bundle
    for extra, words in ((["--debug-rollout-only", "--load-debug-rollout-data", "a{rollout_id}"], "exclude each other"),
                         (["--load-debug-rollout-data-subsample", "0.5"], "needs --load-debug-rollout-data"),
                         (["--save-debug-rollout-data", "/x/{id}.pt"], "only the {rollout_id} placeholder"),
                         (["--rollout-health-check-interval", "0"], "must be > 0")):
        with pytest.raises(SystemExit) as e:
            parse_args(base + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and words in err[0], (extra, err)


def _freeze_engine_after_first_record(out, frozen: list) -> threading.Thread:
    """SIGSTOP this process's embedded engine once rollout 0 is recorded (rollout 1 is then generating)."""
    psutil = pytest.importorskip("psutil")

    def run() -> None:
        path, deadline = out / "metrics.jsonl", time.monotonic() + 300
        while time.monotonic() < deadline and not (path.exists() and path.read_text().strip()):
            time.sleep(0.02)
        for p in psutil.Process().children(recursive=True):
            try:
                if "slime.backends.embedded" in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGSTOP)  # alive, holding its port, answering nothing
                    frozen.append(p)
            except psutil.Error:
                continue

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_train_only_without_saved_rollouts_says_what_to_pass(inputs, tmp_path):
    from slime.config.arguments import parse_args
    from slime.ray.rollout_manager import RolloutError, RolloutManager

    manager = RolloutManager(parse_args(_argv(inputs, tmp_path, "--debug-train-only")))  # no engine: no Ray needed
    assert manager.engines() == []
    with pytest.raises(RolloutError, match="starts no rollout engine: replay saved rollouts with --load-debug-"):
        manager.generate_rollout(0)


@pytest.fixture(scope="module")
def full_and_replay(inputs, ray_session):
    from slime.config.arguments import parse_args
    from slime.train import train

    d = inputs["dir"]
    template = str(d / "rollouts" / "{rollout_id}.pt")
    frozen: list = []
    watcher = _freeze_engine_after_first_record(d / "run_full", frozen)
    # split placement, health checks on; requests to the frozen engine would wait 300 s
    full = train(parse_args(_argv(inputs, d / "run_full", "--rollout-num-gpus", "1", "--save", str(d / "ckpt_full"),
                                  "--save-interval", "1", "--save-debug-rollout-data", template,
                                  "--use-fault-tolerance", "--rollout-health-check-interval", "0.5",
                                  "--rollout-health-check-timeout", "2", "--rollout-request-timeout", "300")))
    watcher.join(timeout=5)
    # no --prompt-data: the samples can only come from the saved files
    replay = train(parse_args(_argv(inputs, d / "run_replay", "--save", str(d / "ckpt_replay"), "--save-interval", "1",
                                    "--load-debug-rollout-data", template, prompts=False)))
    return {"full": full, "replay": replay, "dir": d, "template": template, "frozen": frozen}


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(path))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_replay_reproduces_loss_grads_and_weights_bit_for_bit(full_and_replay):
    full, replay, d = full_and_replay["full"], full_and_replay["replay"], full_and_replay["dir"]
    assert sorted(os.listdir(d / "rollouts")) == ["0.pt", "1.pt"]
    assert [r["rollout_id"] for r in replay] == [0, 1]
    assert all(r["time/weight_sync"] == 0.0 and "weight_sync/checked_tensors" not in r for r in replay)  # no engine
    assert full[0]["train/grad_norm"] > 0 and full[0]["rollout/reward_std"] > 0  # a step that trains
    for a, b in zip(full, replay):
        for key in TRAIN_KEYS:
            assert a[key] == b[key], (key, a[key], b[key])  # bit for bit, not approximately
    for it in ("iter_0000000", "iter_0000001"):
        wa, wb = _checkpoint(d / "ckpt_full" / it), _checkpoint(d / "ckpt_replay" / it)
        assert wa.keys() == wb.keys() and len(wa) > 100
        assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:3]
    w0, w1 = _checkpoint(d / "ckpt_full" / "iter_0000000"), _checkpoint(d / "ckpt_full" / "iter_0000001")
    assert sum(not torch.equal(w0[k], w1[k]) for k in w0) > 50  # the second step moved the weights


def test_frozen_engine_is_found_by_the_health_checks_restarted_and_resynced(full_and_replay):
    """--use-fault-tolerance: the engine frozen after rollout 0 was found by the health checks (within interval +
    timeout), killed, restarted and given the trainer's weights; the run finished every rollout."""
    full, frozen = full_and_replay["full"], full_and_replay["frozen"]
    assert len(frozen) == 1 and (not frozen[0].is_running() or frozen[0].status() == "zombie")
    assert [r["rollout_id"] for r in full] == [0, 1]
    assert sum(r["rollout/health_check_restarts"] for r in full) == 1
    assert sum(r["rollout/engine_restarts"] for r in full) == 1
    assert full[1]["rollout/health_check_restarts"] == 1  # found while rollout 1 ran (or before its sync)
    assert full[1]["time/rollout"] + full[1]["time/weight_sync"] < 120  # not the 300 s request timeout
    assert all(r["weight_sync/checked_tensors"] > 0 for r in full)


def test_debug_rollout_only_saves_rollouts_without_a_trainer(inputs, full_and_replay):
    from slime.config.arguments import parse_args
    from slime.rollout import debug_data
    from slime.train import train

    d = inputs["dir"]
    template = str(d / "rollouts_only" / "{rollout_id}.pt")
    records = train(parse_args(_argv(inputs, d / "run_rollout_only", "--colocate", "--debug-rollout-only",
                                     "--save-debug-rollout-data", template, "--num-rollout", "1", "--eval-interval", "1",
                                     "--eval-prompt-data", "copy", inputs["eval_data"], "--eval-temperature", "0",
                                     "--n-samples-per-eval-prompt", "1")))
    assert [r["rollout_id"] for r in records] == [0]
    # evaluations before and after the rollout: upstream's eval_<N> files of their samples
    assert sorted(os.listdir(d / "rollouts_only")) == ["0.pt", "eval_0.pt", "eval_1.pt"]
    assert len(debug_data.load_rollout(template, "eval_1")) == 4
    assert all("train/loss" not in r and r["rollout/samples"] == 16 for r in records)
    from slime.utils.metrics import console_line

    assert "reward" in console_line(records[0], 1) and "loss" not in console_line(records[0], 1)  # no nan fields
    assert not (d / "run_rollout_only" / "ckpt").exists()
    # rollout 0 of the full run came from the same initial weights, seeds and prompts: the same samples
    ours, theirs = (debug_data.load_rollout(t, 0) for t in (template, full_and_replay["template"]))
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    flat = [[x for s in samples for x in s.rollout_log_probs] for samples in (ours, theirs)]
    assert flat[0] == pytest.approx(flat[1], abs=1e-5)


def test_keep_old_actor_old_log_probs_come_from_upstreams_copy(inputs, tmp_path):
    """One trainer rank trains three rollouts (tests/keep_old_actor_worker.py) whose "engine" log-probs are an
    earlier weight copy's: with --keep-old-actor the old log-probs equal that copy's exactly (abs diff 0.0) while
    the trainer holds newer weights (ppo_kl > 0). As a no-op (old = current weights) steps 1 and 2 would show the
    one-step drift instead of 0 and a ppo_kl of 0."""
    from keep_old_actor_worker import run
    from rank_spawn import spawn

    from slime.utils.net import free_port

    out = tmp_path / "keep_old.pt"
    spawn(run, args=(free_port(), inputs["model"], str(out)), nprocs=1)
    result = torch.load(out, weights_only=True)
    for interval in (1, 2):
        runs, moved = result[interval]["runs"], result[interval]["moved"]
        assert all(m > 1e-4 for m in moved), moved  # every step moved the weights
        assert [r["train_rollout_logprob_abs_diff"] for r in runs] == [0.0, 0.0, 0.0], (interval, runs)
        # the copy is older than the trained weights at step 1 (both), step 2 (interval 1: W1 while training W2);
        # it is the current weights at step 0 and, right after the sync, at step 2 of interval 2
        older = [False, True, True] if interval == 1 else [False, True, False]
        assert [abs(r["train/ppo_kl"]) > 1e-6 for r in runs] == older, (interval, runs)
