"""Bad inputs fail before Ray starts: exit status 2, one line naming the file or flag, nothing written.

Each case runs `slime.train.main` in this process (it returns before Ray and before importing torch for
the run); one case also runs `train.py` as a subprocess to check the real exit status and stderr.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest

from slime.config import preflight as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("pf") / "model"))


def _tree(root) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(root):
        out |= {os.path.join(d, x) for x in dirs + files}
    return out


def _prompts(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _argv(model, data, out, *extra):
    return ["--hf-checkpoint", model, "--prompt-data", data, "--rm-type", "synthetic", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--output-dir", out, *extra]


def _run_main(capsys, argv) -> tuple[int, list[str]]:
    from slime.train import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse-level errors (parse_args) exit the same way
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


def _copy_model(model, dst) -> str:
    import shutil

    shutil.copytree(model, dst)
    return str(dst)


def _truncate(path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def _case(name, tmp_path, model):
    """(argv, the text the error line must name) for one bad input."""
    good = _prompts(tmp_path / "good.jsonl", [{"prompt": "copy : a b =", "label": "a b"}] * 3)
    out = str(tmp_path / "run")
    if name == "no_config":
        m = _copy_model(model, tmp_path / "m")
        os.remove(os.path.join(m, "config.json"))
        return _argv(m, good, out), "config.json"
    if name == "model_type":
        m = _copy_model(model, tmp_path / "m")
        cfg = json.load(open(os.path.join(m, "config.json")))
        cfg["model_type"] = "not_a_model"
        json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
        return _argv(m, good, out), "not_a_model"
    if name == "truncated_safetensors":
        m = _copy_model(model, tmp_path / "m")
        st = os.path.join(m, "model.safetensors")
        _truncate(st, os.path.getsize(st) - 100)
        return _argv(m, good, out), "model.safetensors"
    if name == "malformed_prompts":
        bad = _prompts(tmp_path / "bad.jsonl", [{"prompt": "x", "label": "y"}, "{not json"])
        return _argv(model, bad, out), "bad.jsonl:2"
    if name == "keyless_prompts":
        bad = _prompts(tmp_path / "bad.jsonl", [{"question": "x", "label": "y"}])
        return _argv(model, bad, out), "--input-key"
    if name == "unlabelled_prompts":
        bad = _prompts(tmp_path / "bad.jsonl", [{"prompt": "x", "label": "y"}, {"prompt": "z"}])
        return _argv(model, bad, out), "bad.jsonl:2"
    if name == "batch_size_zero":
        argv = _argv(model, good, out)
        argv[argv.index("--rollout-batch-size") + 1] = "0"
        return argv, "--rollout-batch-size"
    if name == "unwritable_save":
        return _argv(model, good, out, "--save", "/proc/x"), "--save /proc/x"
    if name == "truncated_rank_file":
        load = tmp_path / "ckpt"
        it = load / "iter_0000003"
        it.mkdir(parents=True)
        (load / P.TRACKER).write_text("3")
        (it / "meta.json").write_text("{}")
        with zipfile.ZipFile(it / "rank_00000.pt", "w") as z:
            z.writestr("archive/data.pkl", b"x" * 4096)
        _truncate(it / "rank_00000.pt", 2000)
        return _argv(model, good, out, "--load", str(load)), "rank_00000.pt"
    if name == "truncated_torch_dist":
        load = _torch_dist(tmp_path / "ckpt", 2)
        shard = sorted((load / "iter_0000002").glob("*.distcp"))[0]
        _truncate(shard, shard.stat().st_size // 2)
        return _argv(model, good, out, "--load", str(load)), shard.name
    if name == "other_runs_metrics":
        os.makedirs(out)
        with open(os.path.join(out, P.METRICS_FILE), "w") as f:
            f.write(json.dumps({"rollout_id": 0}) + "\n")
        return _argv(model, good, out), "--output-dir"
    raise AssertionError(name)


CASES = ("no_config", "model_type", "truncated_safetensors", "malformed_prompts", "keyless_prompts",
         "unlabelled_prompts", "batch_size_zero", "unwritable_save", "truncated_rank_file", "truncated_torch_dist",
         "other_runs_metrics")


def _torch_dist(root, iteration: int):
    """A torch.distributed.checkpoint directory laid out as --save writes it (tracker + iter_XXXXXXX with
    megatron's metadata.json), from one process; it holds a key for every weight of the `model` fixture's
    architecture (the preflight compares the key set, from .metadata alone)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from slime.backends.megatron.checkpoint.keys import UPSTREAM, expected_keys
    from slime_plugins.models.glm5.tiny import tiny_config
    from slime_plugins.models.registry import parse_hf_config

    _, arch = parse_hf_config(tiny_config().to_dict())
    weights = {k: torch.zeros(1) for k in expected_keys(arch, UPSTREAM, stacked=False)}
    d = root / f"iter_{iteration:07d}"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8), **weights}, checkpoint_id=str(d),
             no_dist=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (root / P.TRACKER).write_text(str(iteration))
    return root


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(name, tmp_path, model, capsys):
    argv, named = _case(name, tmp_path, model)
    before = _tree(tmp_path)
    rc, err = _run_main(capsys, argv)
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith("train.py: error: ") and named in err[0], err[0]
    assert _tree(tmp_path) == before  # no output dir, checkpoint or probe file left


def test_train_py_subprocess_exit_2(tmp_path, model):
    argv, named = _case("no_config", tmp_path, model)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "run")


def test_good_inputs_pass_and_report_the_prompt_count(tmp_path, model):
    from slime.config.arguments import parse_args

    data = _prompts(tmp_path / "d.jsonl", [{"prompt": "a", "label": "a"}, {"prompt": "b", "label": "b"}, ""])
    args = parse_args(_argv(model, data, str(tmp_path / "run"), "--save", str(tmp_path / "ckpt" / "x")))
    report = P.run_preflight(args)
    assert (report.prompts, report.labelled, report.resume_iteration) == (2, 2, None)
    assert report.lines(args) == [f"prompts: 2 in {data} (2 with a label)"]
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "ckpt")


def test_custom_reward_needs_no_label(tmp_path, model):
    from slime.config.arguments import parse_args

    data = _prompts(tmp_path / "d.jsonl", [{"prompt": "a"}])
    argv = _argv(model, data, str(tmp_path / "run"))
    argv[argv.index("--rm-type"):argv.index("--rm-type") + 2] = ["--custom-rm-path", "slime.rollout.rewards.math_reward"]
    assert P.run_preflight(parse_args(argv)).labelled == 0


def test_resume_is_allowed_and_reported(tmp_path, model):
    from slime.config.arguments import parse_args

    load = _torch_dist(tmp_path / "ckpt", 1)
    out = tmp_path / "run"
    out.mkdir()
    (out / P.METRICS_FILE).write_text(json.dumps({"rollout_id": 0}) + "\n")
    data = _prompts(tmp_path / "d.jsonl", [{"prompt": "a", "label": "a"}])
    # (the stand-in checkpoint holds no optimizer state: its weights and iteration, fresh Adam)
    args = parse_args(_argv(model, data, str(out), "--load", str(load), "--save", str(load), "--no-load-optim"))
    report = P.run_preflight(args)
    assert report.resume_iteration == 1
    assert f"resuming from {load} after rollout 1" in report.lines(args)
    # a --save dir of another run, without --load: refused; --overwrite-output allows it
    args = parse_args(_argv(model, data, str(tmp_path / "fresh"), "--save", str(load)))
    with pytest.raises(P.PreflightError, match="--save"):
        P.run_preflight(args)
    args = parse_args(_argv(model, data, str(tmp_path / "fresh"), "--save", str(load), "--overwrite-output"))
    P.run_preflight(args)


def _safetensors(path, header: dict, data_bytes: int) -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return str(path)


def test_safetensors_header_checks(tmp_path):
    ok = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}, "__metadata__": {"format": "pt"}}
    assert P.check_safetensors(_safetensors(tmp_path / "ok.safetensors", ok, 32)) == 2
    with pytest.raises(P.PreflightError, match="truncated"):
        P.check_safetensors(_safetensors(tmp_path / "short.safetensors", ok, 31))
    wrong = dict(ok, b={"dtype": "F32", "shape": [4], "data_offsets": [24, 32]})
    with pytest.raises(P.PreflightError, match="tensor b spans 8 bytes"):
        P.check_safetensors(_safetensors(tmp_path / "wrong.safetensors", wrong, 32))
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(P.PreflightError, match="no header"):
        P.check_safetensors(str(tmp_path / "tiny.safetensors"))
