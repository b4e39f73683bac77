"""Parallel sizes the model or the device count refuses are found before Ray, in the run and in --dry-run:
exit 2, one line naming the sizes that would work, nothing written. A JSON line's error gives json's whole
reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from slime.config.parallel_sizes import check_parallel_sizes  # noqa: F401 - the module under test imports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkpoint(d, **overrides) -> str:
    """config.json of the tiny GLM-4.7 (GQA attention, a dense layer, shared + 8 routed experts) with overrides:
    heads 4, query groups 2, vocab 512, FFN 128, expert FFN 32, 3 layers."""
    from slime_plugins.models.registry import get_family

    cfg = get_family("glm4_moe").call("tiny_config").to_dict() | overrides
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _argv(model: str, out, devices: int, *sizes: str) -> list[str]:
    return ["--hf-checkpoint", model, "--num-rollout", "1", "--rollout-batch-size", "12", "--n-samples-per-prompt",
            "1", "--actor-num-gpus-per-node", str(devices), "--output-dir", str(out / "run"), "--save",
            str(out / "ckpt"), *sizes]


# (config.json overrides, trainer devices, parallel flags, what the line names, the valid sizes it lists)
CASES = {
    "heads by TP": ({}, 3, ["--tensor-model-parallel-size", "3"], "num_attention_heads=4 % tp=3", "valid sizes for this model with 3 trainer device(s), PP 1, CP 1: 1"),
    "query groups by TP": ({}, 4, ["--tensor-model-parallel-size", "4"], "num_key_value_heads=2 % tp=4", ": 1, 2"),
    "vocab by TP": ({"vocab_size": 510, "num_attention_heads": 8, "num_key_value_heads": 4}, 4,
                    ["--tensor-model-parallel-size", "4"], "vocab_size=510 % tp=4", ": 1, 2"),
    "FFN by TP": ({"intermediate_size": 129}, 4, ["--tensor-model-parallel-size", "2"], "intermediate_size=129 % tp=2", ": 1"),
    "expert FFN by TP": ({"moe_intermediate_size": 33}, 2, ["--tensor-model-parallel-size", "2"],
                         "moe_intermediate_size * n_shared_experts=33 % tp=2", ": 1"),
    "experts by EP": ({}, 3, ["--expert-model-parallel-size", "3"], "n_routed_experts=8 % ep=3", "PP 1: 1"),
    "layers by PP": ({}, 4, ["--pipeline-model-parallel-size", "4"], "exceeds the model's 3 decoder layers", "CP 1: 1, 2"),
    "world by CP": ({}, 4, ["--context-parallel-size", "3"], "do not divide into TP 1 x PP 1 x CP 3 = 3",
                    "--tensor-model-parallel-size none; --pipeline-model-parallel-size none; --context-parallel-size 1, 2, 4"),
}


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_parallel_size_is_one_line_naming_valid_sizes(tmp_path, capsys, case, dry_run):
    from slime.train import _main

    overrides, devices, sizes, named, valid = CASES[case]
    model = _checkpoint(tmp_path / "model", **overrides)
    out = tmp_path / "out"
    out.mkdir()
    argv = _argv(model, out, devices, *sizes) + (["--dry-run"] if dry_run else [])
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        _main(argv)
    assert e.value.code == 2 and time.monotonic() - start < 10
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), lines
    assert named in lines[0] and valid in lines[0], lines[0]
    assert "dry run OK" not in captured.out
    assert os.listdir(out) == []  # no run dir, no run.json, no checkpoint dir


def test_the_valid_sizes_named_are_accepted(tmp_path):
    """Each size the heads line offers passes the check (and the refused one does not)."""
    from slime.config.arguments import parse_args

    model = _checkpoint(tmp_path / "model", num_attention_heads=12, num_key_value_heads=6, vocab_size=600,
                        intermediate_size=96, moe_intermediate_size=24)
    for tp in (1, 2, 3, 6):
        args = parse_args(_argv(model, tmp_path, 6, "--tensor-model-parallel-size", str(tp), "--dry-run"))
        assert args.run_config.parallel.tensor_model_parallel_size == tp
    with pytest.raises(SystemExit):
        parse_args(_argv(model, tmp_path, 4, "--tensor-model-parallel-size", "4", "--dry-run"))


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_train_py_exits_2_within_10_s(tmp_path, dry_run):
    """The issue's command (3 devices, TP 3, a 4-head model) as a new process: exit 2 before Ray, in seconds.
    Timed as the process's CPU seconds: its wall time on a shared, loaded machine measures the other load."""
    import resource

    model = _checkpoint(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    argv = _argv(model, out, 3, "--tensor-model-parallel-size", "3") + (["--dry-run"] if dry_run else [])
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *argv], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "valid sizes" in lines[0], lines
    assert took < 10, f"exit 2 after {took:.1f} CPU seconds"
    assert os.listdir(out) == []


def test_prompt_json_error_gives_the_whole_reason(tmp_path):
    from slime.rollout.prompt_files import PromptFileError, read_records

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "tab\there"}\n')
    with pytest.raises(PromptFileError) as e:
        list(read_records(str(bad)))
    assert "bad.jsonl:2 is not valid JSON (Invalid control character '\\t' at column 16; escape tabs" in str(e.value)
    bad.write_text('{"prompt": "a",}\n')
    with pytest.raises(PromptFileError) as e:
        list(read_records(str(bad)))
    assert "(Expecting property name enclosed in double quotes at column 16, found '}')" in str(e.value)


def test_dry_run_refuses_a_prompt_file_the_run_would_refuse(tmp_path, capsys):
    """The dry run reads --prompt-data when it exists (keys, labels), as the run's preflight does."""
    from slime.train import _main

    model = _checkpoint(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "What is 2+3?", "answer": "5"}\n')
    out = tmp_path / "out"
    out.mkdir()
    base = _argv(model, out, 1) + ["--prompt-data", str(prompts), "--label-key", "answer", "--rm-type", "math",
                                   "--dry-run"]
    assert _main(base + ["--input-key", "prompt"]) == 2
    captured = capsys.readouterr()
    assert "has no key 'prompt'; set --input-key to the prompt's key" in captured.out + captured.err
    assert "dry run OK" not in captured.out
    assert _main(base + ["--input-key", "question"]) == 0
    assert "dry run OK" in capsys.readouterr().out
