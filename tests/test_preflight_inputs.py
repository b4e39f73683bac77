"""Inputs that used to fail only after Ray had started, or were accepted silently: each is found before Ray
(train.py exits 2 with one line naming the flag, nothing written) or accepted with one warning line."""

from __future__ import annotations

import json
import os

import pytest

from slime.config.arguments import parse_args
from slime.config.preflight import run_preflight


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from glm5_helpers import write_run_inputs

    return write_run_inputs(tmp_path_factory.mktemp("inputs"), 16, (5, 9))


def _argv(assets, out, *extra: str) -> list[str]:
    return ["--hf-checkpoint", assets["model"], "--prompt-data", assets["data"], "--apply-chat-template",
            "--rm-type", "synthetic", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "6", "--global-batch-size", "8", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", "256", "--num-rollout", "2", "--output-dir", str(out / "run"),
            "--save", str(out / "ckpt"), *extra]


def _refused(capsys, argv, out) -> str:
    from slime.train import _main

    before = sorted(os.listdir(out))
    assert _main(argv) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), lines
    assert sorted(os.listdir(out)) == before  # nothing written
    return lines[0]


@pytest.mark.parametrize("extra, named", [
    (["--eval-prompt-data", "copy", "{out}/missing.jsonl"], "--eval-prompt-data copy {out}/missing.jsonl cannot be read"),
    (["--rollout-engine", "sglang"], "--rollout-engine sglang"),
    (["--num-cpus", "0"], "--num-cpus 0"),
    (["--rollout-max-prompt-len", "2"], "--rollout-max-prompt-len 2 drops every prompt"),
    (["--save", "{model}"], "--save {model} is the --hf-checkpoint model directory"),
    (["--save", "{model}", "--load", "{model}"], "--save {model} is the --hf-checkpoint model directory"),
    (["--output-dir", "{model}"], "--output-dir {model} is the --hf-checkpoint model directory"),
])
def test_refused_before_ray_in_one_line(assets, tmp_path, capsys, extra, named):
    import importlib.util

    if extra[:2] == ["--rollout-engine", "sglang"] and importlib.util.find_spec("triton") is not None \
            and importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang can start here")
    fill = {"out": str(tmp_path), "model": assets["model"]}
    line = _refused(capsys, _argv(assets, tmp_path, *[x.format(**fill) for x in extra]), tmp_path)
    assert named.format(**fill) in line, line


def test_model_dir_is_left_untouched(assets, tmp_path, capsys):
    before = sorted(os.listdir(assets["model"]))
    _refused(capsys, _argv(assets, tmp_path, "--save", assets["model"], "--load", assets["model"]), tmp_path)
    assert sorted(os.listdir(assets["model"])) == before


@pytest.mark.parametrize("value", ["cuda", "gpu"])
def test_unusable_accelerator_is_one_line(assets, tmp_path, capsys, monkeypatch, value):
    from slime.accelerator import get_accelerator, set_accelerator

    if value == "cuda" and get_accelerator().name == "cuda":
        pytest.skip("CUDA is usable here")
    previous = get_accelerator()
    monkeypatch.setenv("SLIME_ACCELERATOR", value)
    set_accelerator(None)  # detect again, under the variable
    try:
        line = _refused(capsys, _argv(assets, tmp_path), tmp_path)
    finally:
        set_accelerator(previous)
    assert f"SLIME_ACCELERATOR={value}" in line or f"SLIME_ACCELERATOR={value!r}" in line, line


def _warnings(assets, tmp_path, *extra) -> list[str]:
    report = run_preflight(parse_args(_argv(assets, tmp_path, *extra)))
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "ckpt")
    return report.warnings


def test_accepted_but_wrong_combinations_warn_in_one_line(assets, tmp_path):
    assert _warnings(assets, tmp_path) == []
    w = _warnings(assets, tmp_path, "--use-kl-loss")
    assert len(w) == 1 and "--kl-loss-coef 0 adds no KL term" in w[0]
    w = _warnings(assets, tmp_path, "--use-kl-loss", "--kl-loss-coef", "0.01")
    assert len(w) == 1 and "without --ref-load" in w[0] and assets["model"] in w[0]
    w = _warnings(assets, tmp_path, "--max-tokens-per-gpu", "4")
    assert len(w) == 1 and w[0].startswith("--max-tokens-per-gpu 4 is below one sample")
    w = _warnings(assets, tmp_path, "--actor-num-gpus-per-node", "4", "--num-cpus", "2", "--global-batch-size", "8")
    assert len(w) == 1 and "4 trainer ranks" in w[0] and "2 CPU cores" in w[0]
    assert all("\n" not in x for x in w)


def test_max_prompt_len_that_drops_some_prompts_is_a_warning(assets, tmp_path):
    from transformers import AutoTokenizer

    from slime.rollout.data_source import tokenize_prompt

    tok = AutoTokenizer.from_pretrained(assets["model"])
    with open(assets["data"]) as f:
        lengths = sorted(len(tokenize_prompt(tok, json.loads(x)["prompt"], True)) for x in f)
    assert lengths[0] < lengths[-1]  # prompts of 5..9 characters
    limit = lengths[len(lengths) // 2]
    w = _warnings(assets, tmp_path, "--rollout-max-prompt-len", str(limit))
    dropped = sum(n > limit for n in lengths)
    assert w == [f"--rollout-max-prompt-len {limit} drops {dropped} of {len(lengths)} prompts (the longest is "
                 f"{lengths[-1]} tokens with the chat template)"]
