"""Every scripts/models/*.sh agrees with the config.json it describes, through the checks that read it: train.py's
(slime.config.model_args, which the converter tools/convert_hf_to_torch_dist.py runs too) and, for the scripts
whose flags only the planner reads, slime.plan.model_args."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script -> the config it describes (scripts/models/configs/NAME.json; "tiny": the tiny GLM-5 writer's config)
DESCRIBES = {
    "glm4.5-355B-A32B": "glm4.7-355B-A32B", "glm4.7-30B-A3B": "glm4.7-30B-A3B",
    "glm4.7-355B-A32B": "glm4.7-355B-A32B", "glm4.7-flash": "glm4.7-30B-A3B", "glm5": "glm5-744B-A40B",
    "glm5-744B-A40B": "glm5-744B-A40B", "glm5.2-744B-A40B": "glm5.2-744B-A40B", "glm5.3-flash": "glm5.3-flash",
    "glm5-tiny": "tiny", "qwen3-30B-A3B": "qwen3-30B-A3B", "qwen3-32B": "qwen3-32B", "qwen3-4B": "qwen3-4B",
}
# MODEL_ARGS with Megatron flags train.py's parser does not take yet (KDA's linear-attention sizes, the SwiGLU
# clamp): checked by the planner, which the cluster script runs them through (slime.plan.model_args)
PLANNER_ONLY = {"glm5.3-flash"}


def _model_args(script: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/models/{script}.sh"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         check=True, capture_output=True, text=True).stdout
    return out.splitlines()


def _config(name: str) -> dict:
    if name == "tiny":
        from slime_plugins.models.glm5.tiny import tiny_config

        return tiny_config().to_dict()
    from slime.plan.model import load_config

    return load_config(name)[1]


def test_every_model_script_is_listed():
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "scripts", "models")) if f.endswith(".sh")}
    assert scripts == set(DESCRIBES)


@pytest.mark.parametrize("script", sorted(set(DESCRIBES) - PLANNER_ONLY))
def test_model_args_agree_with_train_and_the_converter(script, tmp_path, capsys):
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist_args
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv, cfg = _model_args(script), _config(DESCRIBES[script])
    assert len(argv) > 15
    assert model_arg_mismatches(build_parser().parse_args(argv), cfg) == []
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    # upstream's converter command line with these MODEL_ARGS gets past its MODEL_ARGS check (the weights it
    # would convert are not here: what it says after the check does not matter)
    try:
        hf_to_torch_dist_args([*argv, "--hf-checkpoint", str(tmp_path), "--save", str(tmp_path / "out")])
    except SystemExit:
        pass
    err = capsys.readouterr().err
    assert "MODEL_ARGS disagree" not in err and "safetensors weights" not in err, err


@pytest.mark.parametrize("script", sorted(PLANNER_ONLY))
def test_planner_only_model_args_agree_with_the_planner(script):
    from slime.plan.model_args import mismatches

    assert mismatches(_model_args(script), _config(DESCRIBES[script])) == []


def test_a_wrong_switch_is_caught():
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv = [a for a in _model_args("glm5-tiny") if a != "--qk-layernorm"]
    assert model_arg_mismatches(build_parser().parse_args(argv), _config("tiny")) == [
        "--qk-layernorm absent: config.json says q/k norms"]


def test_tiny_checkpoint_directory_has_the_umask_mode(tmp_path):
    """The written model directory is readable like any other (0777 less the umask), not mkdtemp's 0700."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    old = os.umask(0o022)
    try:
        out = write_tiny_checkpoint(str(tmp_path / "m"), "qwen2", seed=0)
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o755


@pytest.mark.parametrize("flags, quiet", [([], "-q"), (["-q"], ""), (["-v"], "")])
def test_test_sh_adds_q_only_when_no_verbosity_is_given(tmp_path, flags, quiet):
    """scripts/test.sh -q runs pytest with one -q (pytest's summary line stays), not -qq."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".slime-installed").write_text("")  # not the stamp: setup-venv.sh is bypassed below
    script = (open(os.path.join(ROOT, "scripts", "test.sh")).read()
              .replace('bash "$ROOT/scripts/setup-venv.sh"', ":"))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text(script)
    env = dict(os.environ, SLIME_VENV=str(venv), SLIME_TEST_WORKERS="0")
    subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), *flags], env=env, check=True)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:2] == ["-m", "pytest"] and argv.count("-q") == (1 if quiet or flags == ["-q"] else 0)
    assert "-qq" not in argv
