"""train.py's parser errors: one line (no usage block), the closest flag names for an unknown one, no
abbreviations (`--num-roll` is not taken for `--num-rollout`), negative numbers taken as values."""

from __future__ import annotations

import pytest

from slime.config.arguments import build_parser, parse_args

BASE = ["--num-rollout", "2", "--rollout-batch-size", "2"]


def _error_lines(capsys, argv) -> list[str]:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return [x for x in capsys.readouterr().err.splitlines() if x.strip()]


@pytest.mark.parametrize("typo, closest", [("--num-rolout", "--num-rollout"), ("--num-roll", "--num-rollout"),
                                           ("--colocat", "--colocate"), ("--rollout-batchsize", "--rollout-batch-size")])
def test_unknown_flag_is_one_line_naming_the_closest(capsys, tmp_path, typo, closest):
    lines = _error_lines(capsys, ["--hf-checkpoint", str(tmp_path), *BASE, typo, "1"])
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"train.py: error: unrecognized arguments: {typo}")
    assert f"did you mean {closest}" in lines[0], lines[0]


def test_unknown_flag_without_a_near_name_points_at_help(capsys, tmp_path):
    lines = _error_lines(capsys, ["--hf-checkpoint", str(tmp_path), *BASE, "--zzzz-qqqq", "3"])
    assert lines == ["train.py: error: unrecognized arguments: --zzzz-qqqq 3; train.py --help lists the flags"]


def test_no_abbreviations():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--num-roll", "3"])
    assert build_parser().parse_args(["--num-rollout", "3"]).num_rollout == 3


@pytest.mark.parametrize("text, value", [("-1e-3", -1e-3), ("-1E+2", -100.0), ("-.5", -0.5), ("-2.", -2.0),
                                         ("-7", -7.0), ("-3.25e-07", -3.25e-07)])
def test_negative_numbers_are_values(text, value):
    args = build_parser().parse_args(["--lr", text, "--rollout-top-k", "-1"])
    assert args.lr == value and args.rollout_top_k == -1


def test_negative_lr_fails_validation_not_parsing(capsys, tmp_path):
    lines = _error_lines(capsys, ["--hf-checkpoint", str(tmp_path), *BASE, "--lr", "-1e-3"])
    assert len(lines) == 1 and "--lr" in lines[0] and "expected one argument" not in lines[0], lines


def test_other_parse_errors_are_one_line(capsys, tmp_path):
    lines = _error_lines(capsys, ["--hf-checkpoint", str(tmp_path), *BASE, "--lr", "abc"])
    assert lines == ["train.py: error: argument --lr: invalid float value: 'abc'"]
    lines = _error_lines(capsys, ["--hf-checkpoint", str(tmp_path), *BASE, "--lr"])
    assert lines == ["train.py: error: argument --lr: expected one argument"]
