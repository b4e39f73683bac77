"""docs/gpu.md's single-node recipe (scripts/run-glm4.7-flash-8xgpu.sh) dry-runs on CPU for 8 x H100 and
8 x H200 from config.json alone, and its memory plan fits; the doc's numbers are the planner's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "run-glm4.7-flash-8xgpu.sh")


@pytest.mark.parametrize("device, usable", [("h100", "69.6"), ("h200", "125.7")])
def test_single_node_recipe_dry_runs_and_fits(tmp_path, device, usable):
    model = tmp_path / "GLM-4.7-Flash"
    model.mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "models", "configs", "glm4.7-30B-A3B.json"), model / "config.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIME_")}
    env.update(HF_CHECKPOINT=str(model), PLAN_DEVICE=device, PYTHON=sys.executable, SAVE_DIR=str(tmp_path / "ckpt"),
               OUTPUT_DIR=str(tmp_path / "out"), RAY_AUTH_MODE="disabled")
    r = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "dry run OK" in out and "MODEL_ARGS agree with config.json" in out
    assert "layout: world 8 = dp 4 x tp 2 x pp 1 x cp 1; experts: ep 8 x etp 1" in out
    peak = re.search(r"peak vs usable\s+([\d.]+) / ([\d.]+)\s+FITS", out)
    assert peak, out[-2000:]
    assert peak.group(2) == usable
    doc = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    name = {"h100": "H100", "h200": "H200"}[device]
    assert f"{name}: {peak.group(1)} of {usable} GB usable" in doc  # the doc's table is this plan
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "ckpt")


def test_readme_points_gpu_users_to_docs_gpu():
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = next(x for x in readme.splitlines() if x.startswith("GPU and Ascend installs"))
    assert "docs/gpu.md" in line
