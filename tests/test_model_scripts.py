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
# MODEL_ARGS the cluster script also runs through the planner's check (slime.plan.model_args)
PLANNER_CHECKED = {"glm5.3-flash"}


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


@pytest.mark.parametrize("script", sorted(DESCRIBES))
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


@pytest.mark.parametrize("script", sorted(PLANNER_CHECKED))
def test_model_args_agree_with_the_planner(script):
    from slime.plan.model_args import mismatches

    assert mismatches(_model_args(script), _config(DESCRIBES[script])) == []


def _glm5_next_dry_run(tmp_path, model_args):
    """`python train.py "${MODEL_ARGS[@]}" --hf-checkpoint DIR ... --dry-run` with the published GLM-5.3-Flash
    config.json, in a fresh interpreter."""
    import shutil
    import sys

    (tmp_path / "hf").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts/models/configs/glm5.3-flash.json"), tmp_path / "hf" / "config.json")
    argv = [*model_args, "--hf-checkpoint", str(tmp_path / "hf"), "--output-dir", str(tmp_path / "out"),
            "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rm-type", "math",
            "--prompt-data", str(tmp_path / "prompts.jsonl"), "--dry-run"]
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_glm5_3_flash_model_args_pass_train_py_dry_run(tmp_path):
    """Every flag of scripts/models/glm5.3-flash.sh (Megatron's --linear-attention-freq, --linear-*-heads/-dim,
    --activation-func-clamp-value, --position-embedding-type none, ...) is train.py's and agrees with glm5_next."""
    r = _glm5_next_dry_run(tmp_path, _model_args("glm5.3-flash"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "MODEL_ARGS agree with config.json" in r.stdout and "dry run OK" in r.stdout


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def test_glm5_3_flash_wrong_linear_attention_freq_fails_in_one_line(tmp_path):
    r = _glm5_next_dry_run(tmp_path, _replace(_model_args("glm5.3-flash"), "--linear-attention-freq", "3"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "train.py: error: --linear-attention-freq 3: config.json's layer_types have 34 linear-attention and "
        "11 softmax-attention layers, i.e. --linear-attention-freq 4"]


def _drop(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


@pytest.mark.parametrize("change, line", [
    (lambda a: _replace(a, "--activation-func-clamp-value", "7"),
     "--activation-func-clamp-value 7: config.json says swiglu_limit=10.0"),
    (lambda a: _drop(a, "--activation-func-clamp-value"),
     "--activation-func-clamp-value absent: config.json says swiglu_limit=10.0; add --activation-func-clamp-value 10"),
    (lambda a: _replace(a, "--linear-attention-freq", "[1,1,1,0]*11+[0]"),
     "--linear-attention-freq [1,1,1,0]*11+[0]: config.json's layer_types have 34 linear-attention and 11 "
     "softmax-attention layers, i.e. --linear-attention-freq 4"),
    (lambda a: _drop(a, "--linear-attention-freq"),
     "--linear-attention-freq absent: config.json's layer_types have 34 linear-attention layers; "
     "add --linear-attention-freq 4"),
    (lambda a: _replace(a, "--moe-layer-freq", "[0]*1+[1]*44"),
     "--moe-layer-freq [0]*1+[1]*44: config.json has 3 dense and 42 MoE layers in the pattern [0]*3+[1]*42"),
    (lambda a: _replace(a, "--position-embedding-type", "rope"),
     "--position-embedding-type rope: config.json says position embedding (none: NoPE MLA, qk_rope_head_dim 0)"
     "=none"),
    (lambda a: _replace(a, "--linear-key-head-dim", "64"),
     "--linear-key-head-dim 64: config.json says linear_key_head_dim/linear_head_dim=128"),
])
def test_glm5_3_flash_model_args_are_checked_both_ways(change, line):
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv = change(_model_args("glm5.3-flash"))
    assert model_arg_mismatches(build_parser().parse_args(argv), _config("glm5.3-flash")) == [line]


def test_linear_attention_flags_on_a_model_without_linear_attention_are_caught():
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv = _model_args("glm5-tiny") + ["--linear-attention-freq", "4", "--activation-func-clamp-value", "10"]
    assert model_arg_mismatches(build_parser().parse_args(argv), _config("tiny")) == [
        "--linear-attention-freq 4: config.json has no linear-attention layers (layer_types)",
        "--activation-func-clamp-value 10: config.json has no swiglu_limit (an unclamped SwiGLU)"]


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
