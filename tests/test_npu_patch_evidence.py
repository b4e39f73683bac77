"""docker/npu_patch/README.md says SGLang needs no source patch for GLM-5 on Ascend at the pinned
version, because that version already contains what upstream slime's NPU sglang.patch changed. This
test checks each cited marker in an SGLang source tree of the pinned version; it runs where one is
available (SLIME_SGLANG_SOURCE=<dir holding sglang/>, or an installed sglang) and skips otherwise."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "docker/npu_patch/README.md"

# (file under sglang/srt, regex that must match): the README's evidence table, one row each.
MARKERS = [
    ("models/glm4_moe.py", r"class GlmMoeDsaForCausalLM\(DeepseekV2ForCausalLM\)"),
    ("models/glm4_moe.py", r"EntryClass = \[[^\]]*GlmMoeDsaForCausalLM"),
    ("configs/model_config.py", r"def is_deepseek_dsa\(config\)[\s\S]{0,400}\"GlmMoeDsaForCausalLM\""),
    ("hardware_backend/npu/modules/deepseek_v2_attention_mla_npu.py", r"def forward_dsa_core_npu\("),
    ("layers/attention/dsa/dsa_npu_indexer.py", r"."),
    ("hardware_backend/npu/graph_runner/npu_graph_runner.py",
     r"def _get_update_attr_name\(self\):[\s\S]{0,200}return self\.attr_name\[AttentionArch\.MLA\]"),
    ("layers/rotary_embedding/base.py", r"and not \(_is_npu\)"),
    ("layers/rotary_embedding/base.py",
     r"def forward_npu\([\s\S]{0,600}query\.dtype == torch\.bfloat16\s+and self\.cos_sin_cache\.dtype == torch\.float"),
    ("layers/vocab_parallel_embedding.py", r"@torch\.compile\(dynamic=True, backend=get_compiler_backend\(\), disable=_is_npu\)"),
]


def _pinned_version() -> str:
    text = (ROOT / "docker/Dockerfile.npu").read_text()
    return re.search(r"^ARG SGLANG_VERSION=(\S+)", text, re.M).group(1)


def _source() -> Path | None:
    env = os.environ.get("SLIME_SGLANG_SOURCE")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("sglang")
    return Path(spec.origin).parent.parent if spec and spec.origin else None


def _version(src: Path) -> str | None:
    version_file = src / "sglang/_version.py"
    if version_file.exists():
        m = re.search(r"__version__ = version = '([^']+)'", version_file.read_text())
        return m.group(1) if m else None
    return None


def test_readme_cites_every_marker_file_and_the_pinned_version():
    text = README.read_text()
    assert f"SGLang {_pinned_version()}" in text
    for path, _ in MARKERS:
        assert f"`{path}`" in text, path


def test_pinned_sglang_source_contains_the_cited_ascend_code():
    src = _source()
    if src is None or not (src / "sglang/srt").is_dir():
        pytest.skip("no SGLang source here (set SLIME_SGLANG_SOURCE to a directory holding sglang/)")
    version = _version(src)
    if version is not None and version != _pinned_version():
        pytest.skip(f"SGLang {version} here, the evidence is for the pinned {_pinned_version()}")
    for path, pattern in MARKERS:
        text = (src / "sglang/srt" / path).read_text()
        assert re.search(pattern, text), f"{path}: {pattern!r} not found: the README's evidence no longer holds"
