"""Upstream slime's run scripts on this train.py: their captured command lines (tests/data/
upstream_train_commands.json, with the upstream commit) pass `--dry-run` against a directory that holds
only the matching scripts/models/configs/<model>.json as config.json: no unknown flag, MODEL_ARGS agreeing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests/data/upstream_train_commands.json").read_text())
SCRIPTS = sorted(DATA["scripts"])


def _argv(script: str, tmp_path: Path) -> list[str]:
    entry = DATA["scripts"][script]
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    shutil.copy(ROOT / entry["config"], ckpt / "config.json")
    argv = list(entry["argv"])
    argv[argv.index("--hf-checkpoint") + 1] = str(ckpt)
    if "sglang_config_yaml" in entry:
        yaml_path = tmp_path / "sglang.yaml"
        yaml_path.write_text(entry["sglang_config_yaml"])
        argv[argv.index("{SGLANG_CONFIG}")] = str(yaml_path)
    return argv + ["--output-dir", str(tmp_path / "out"), "--dry-run"]


def test_captured_commands_name_their_upstream_commit():
    assert DATA["repository"] == "THUDM/slime" and len(DATA["commit"]) == 40
    assert set(SCRIPTS) == {"run-glm5-744B-A40B.sh", "run-glm5.2-744B-A40B.sh", "run-glm4.7-30B-A3B.sh",
                            "run-glm4.7-355B-A32B.sh", "run-qwen3-4B.sh"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_upstream_script_dry_run_passes(script, tmp_path, capsys):
    from slime.train import main

    assert main(_argv(script, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "MODEL_ARGS agree with config.json" in out and out.rstrip().endswith("dry run OK")
    assert "error" not in out
    # BASE_DIR paths do not exist here: warnings, not errors
    assert "warning: --prompt-data /BASE/" in out or "warning: --prompt-data /root/" in out


def test_upstream_layout_is_resolved(tmp_path, capsys):
    from slime.train import main

    assert main(_argv("run-glm5.2-744B-A40B.sh", tmp_path)) == 0
    out = capsys.readouterr().out
    # TP4 PP8 CP8 on 256 devices: DP 1; first/last stages 14/16 layers, six middle stages of 8
    assert "world 256 = dp 1 x tp 4 x pp 8 x cp 8" in out
    assert "layers per pipeline stage [14, 8, 8, 8, 8, 8, 8, 16]" in out
    assert "--sglang-config model 'default': prefill 1x64, decode 3x64" in out


def test_model_args_disagreement_is_one_line_naming_flag_and_values(tmp_path, capsys):
    from slime.train import main

    argv = _argv("run-glm4.7-355B-A32B.sh", tmp_path)
    argv[argv.index("--num-layers") + 1] = "90"
    argv[argv.index("--rotary-percent") + 1] = "1.0"
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: --num-layers 90: config.json says num_hidden_layers=92",
                   "train.py: error: --rotary-percent 1.0: config.json says partial_rotary_factor=0.5"]


def test_train_py_dry_run_cli_exits_zero(tmp_path):
    """The real command: `python train.py ARGS --dry-run` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *_argv("run-qwen3-4B.sh", tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run OK" in r.stdout
