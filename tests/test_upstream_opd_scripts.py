"""Upstream slime's two on-policy-distillation example scripts (examples/on_policy_distillation/run-qwen3-8B-opd.sh,
sglang teacher; run-qwen3-8B-opd-megatron.sh, --opd-teacher-load) on this train.py: their captured command lines
(tests/data/upstream_opd_commands.json, tests/data/capture_upstream_opd_commands.py) pass --dry-run against a
Qwen3-8B config.json written here from the script's MODEL_ARGS (qwen3-8B.sh), naming upstream's hooks
(slime.rollout.on_policy_distillation) by their upstream import path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests/data/upstream_opd_commands.json").read_text())
# Qwen3-8B's config.json fields that upstream's scripts/models/qwen3-8B.sh MODEL_ARGS state
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
            "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 40960,
            "attention_bias": False, "torch_dtype": "bfloat16"}


def test_captured_commands_name_their_upstream_commit():
    assert DATA["repository"] == "THUDM/slime" and len(DATA["commit"]) == 40
    assert sorted(DATA["scripts"]) == ["run-qwen3-8B-opd-megatron.sh", "run-qwen3-8B-opd.sh"]


@pytest.mark.parametrize("script", sorted(DATA["scripts"]))
def test_upstream_opd_script_dry_run_passes(script, tmp_path, capsys):
    from slime.train import main

    entry = DATA["scripts"][script]
    assert entry["program"] == "train.py"
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_8B))
    argv = list(entry["argv"])
    argv[argv.index("--hf-checkpoint") + 1] = str(ckpt)
    assert "--use-opd" in argv
    try:
        code = main(argv + ["--output-dir", str(tmp_path / "out"), "--dry-run"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 0, err.strip().splitlines()[-3:]
    assert "MODEL_ARGS agree with config.json" in out and out.rstrip().endswith("dry run OK")
    assert "would fail" not in out and "error" not in out


def test_the_sglang_scripts_hooks_import_at_upstreams_path():
    import inspect

    from slime.utils.misc import load_function

    argv = DATA["scripts"]["run-qwen3-8B-opd.sh"]["argv"]
    reward = load_function(argv[argv.index("--custom-rm-path") + 1])
    post = load_function(argv[argv.index("--custom-reward-post-process-path") + 1])
    assert inspect.iscoroutinefunction(reward) and list(inspect.signature(post).parameters)[:2] == ["args", "samples"]
