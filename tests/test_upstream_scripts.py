"""Upstream slime's run scripts on this train.py: their captured command lines (tests/data/
upstream_train_commands.json, all 23 scripts/run-*.sh of the upstream commit) pass `--dry-run` against a directory
that holds only the matching scripts/models/configs/<model>.json as config.json: no unknown flag, MODEL_ARGS
agreeing, no "would fail at start-up" line. The ones needing what is not built yet are strict xfails naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime.config.megatron_layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests/data/upstream_train_commands.json").read_text())
SCRIPTS = sorted(DATA["scripts"])


# Scripts that need what is not built yet (issue 20 part 2): strict, so each flips to a failure once it passes.
PENDING = {
}


# The acceptance's one allowed exception: a layout Megatron-core's initialize_model_parallel refuses
# (tests/test_megatron_layout.py): upstream's 8-device GLM-4.7-30B-A3B script, TP2 PP2 CP2 with EP8 (EP x PP = 16).
MEGATRON_REFUSES = {"run-glm4.7-30B-A3B.sh": ParallelLayout(8, tp=2, pp=2, cp=2, ep=8, etp=1)}


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


def _main(program: str):
    """The entry point the script submits: train.py or train_async.py (by file, as `python3 <program>` runs it)."""
    import importlib.util

    path = ROOT / program
    assert path.is_file(), f"{program} does not exist"
    if program == "train.py":
        from slime.train import main

        return main
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_captured_commands_name_their_upstream_commit():
    assert DATA["repository"] == "THUDM/slime" and len(DATA["commit"]) == 40
    assert len(SCRIPTS) == 23 and set(PENDING) <= set(SCRIPTS)
    assert {DATA["scripts"][s]["program"] for s in SCRIPTS} == {"train.py", "train_async.py"}
    for s in SCRIPTS:  # every script has its model's config.json
        assert (ROOT / DATA["scripts"][s]["config"]).is_file(), s


@pytest.mark.parametrize("script", [
    pytest.param(s, marks=pytest.mark.xfail(reason=PENDING[s], strict=True)) if s in PENDING else s for s in SCRIPTS])
def test_upstream_script_dry_run_passes(script, tmp_path, capsys, monkeypatch):
    """--dry-run exits 0 with no "would fail" line (memory verdicts are printed, not judged), except a layout
    Megatron-core itself refuses: then the one line says so, and Megatron's own initialisation refuses it too."""
    entry = DATA["scripts"][script]
    try:
        code = _main(entry["program"])(_argv(script, tmp_path))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 0, err.strip().splitlines()[-3:]
    assert "MODEL_ARGS agree with config.json" in out and out.rstrip().endswith("dry run OK")
    if script in MEGATRON_REFUSES:
        from test_megatron_layout import _megatron_verdict

        refusal = _megatron_verdict(MEGATRON_REFUSES[script], monkeypatch)
        assert refusal is not None
        lines = [x for x in out.splitlines() if "would fail" in x]
        assert len(lines) == 1 and f'Megatron-core itself refuses this layout: initialize_model_parallel raises "{refusal}"' \
            in lines[0], lines
        out = out.replace(lines[0], "")
    assert "would fail" not in out and "error" not in out


def test_upstream_script_paths_are_warnings(tmp_path, capsys):
    """BASE_DIR paths do not exist here: warnings, not errors."""
    from slime.train import main

    assert main(_argv("run-qwen3-4B.sh", tmp_path)) == 0
    assert "warning: --prompt-data /root/" in capsys.readouterr().out


def test_upstream_layout_is_resolved(tmp_path, capsys):
    from slime.train import main

    assert main(_argv("run-glm5.2-744B-A40B.sh", tmp_path)) == 0  # its 64-device engines span 8 nodes each
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
