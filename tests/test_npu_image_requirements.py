"""docker/Dockerfile.npu's pip-installed pins resolve for both Linux platforms the image is built on (aarch64
and x86_64, CPython 3.11), checked without installing: `pip install --dry-run --only-binary=:all: --platform ...
--target` against the indexes the image uses (torch's CPU index for torch, PyPI for the rest). Skipped, with
the reason, where those indexes cannot be reached (offline machines); CI runs it.

What it does not cover: SGLang and sgl-kernel-npu are built from source in the image, and triton-ascend comes
from Huawei's nightly index."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"
PLATFORMS = {"aarch64": ("manylinux_2_28_aarch64", "manylinux2014_aarch64"),
             "x86_64": ("manylinux_2_28_x86_64", "manylinux2014_x86_64")}


def image_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", (ROOT / "docker" / "Dockerfile.npu").read_text(), re.M))


def requirements(args: dict[str, str]) -> list[str]:
    return [f"torch=={args['TORCH_VERSION']}", f"torch-npu=={args['TORCH_NPU_VERSION']}",
            f"megatron-core=={args['MEGATRON_CORE_VERSION']}", f"ray[default]=={args['RAY_VERSION']}"]


def test_the_requirements_are_the_images_pins():
    args = image_args()
    reqs = requirements(args)
    text = (ROOT / "docker" / "Dockerfile.npu").read_text()
    for name in ("TORCH_VERSION", "TORCH_NPU_VERSION", "MEGATRON_CORE_VERSION", "RAY_VERSION"):
        assert f"${{{name}}}" in text, f"Dockerfile.npu no longer installs ${{{name}}}"
    assert reqs[0].startswith("torch==2.") and reqs[1].split("==")[1].startswith(reqs[0].split("==")[1][:4])


def _unreachable(url: str) -> str | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return None
    except Exception as e:  # noqa: BLE001 - any failure means: cannot check from here
        return f"{url} unreachable ({type(e).__name__}: {e})"


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_pins_resolve_for_the_platform(platform, tmp_path):
    why = _unreachable(f"{TORCH_CPU_INDEX}/torch/") or _unreachable(f"{PYPI}/torch-npu/")
    if why:
        pytest.skip(f"cannot resolve the image's requirements here: {why}")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--dry-run",
           "--ignore-installed", "--only-binary=:all:", "--python-version", "3.11", "--target", str(tmp_path / "t"),
           "--index-url", TORCH_CPU_INDEX, "--extra-index-url", PYPI, "--report", str(report)]
    for tag in PLATFORMS[platform]:
        cmd += ["--platform", tag]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    done = subprocess.run(cmd + requirements(image_args()), capture_output=True, text=True, timeout=600, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert done.returncode == 0, f"{platform}: {errors[-1] if errors else done.stderr[-500:]}"
    installed = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                 for i in json.loads(report.read_text())["install"]}
    args = image_args()
    assert installed["torch"].split("+")[0] == args["TORCH_VERSION"]
    assert installed["torch-npu"] == args["TORCH_NPU_VERSION"]
    assert installed["megatron-core"] == args["MEGATRON_CORE_VERSION"] and installed["ray"] == args["RAY_VERSION"]
    assert not [n for n in installed if n.startswith("nvidia-")], "the CPU torch the image needs pulled CUDA wheels"
