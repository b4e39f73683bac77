"""benchmarks/device_check.py (the GPU/NPU validation report) exercised on the CPU: the dry-run plan, a real
tiny run of every section but the pytest one, and a poisoned op that the report must flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device_check.py")


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_dry_run_plans_every_op_and_a_30gb_model(tmp_path):
    from slime.accelerator.ops import OP_NAMES

    r = _run("--out", str(tmp_path), "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    report = (tmp_path / "device-report.md").read_text()
    assert "dry run: nothing was measured" in report
    for name in OP_NAMES:
        for dtype in ("bfloat16", "float32"):
            assert f"| {name} | {dtype} |" in report
    gb = float(re.search(r"= ([\d.]+) GB bfloat16", report).group(1))
    assert 25 <= gb <= 30.5, gb
    assert "imports: megatron-core" in report and "pytest -q -m device tests" in report


def test_cpu_run_measures_and_passes(tmp_path):
    r = _run("--out", str(tmp_path), "--allow-cpu", "--sections", "ops,ipc,collective,model",
             "--ops", "rms_norm,moe_route,lightning_indexer", "--ipc-mb", "1", "--steps", "1")
    report = (tmp_path / "device-report.md").read_text()
    assert r.returncode == 0, report
    assert "every check within its tolerance" in report
    assert "parent saw the child's write: True" in report and "values intact True" in report
    row = next(line for line in report.splitlines() if line.startswith("| tiny |"))
    assert float(row.split("|")[5].split()[0]) < 1e-4  # log-probs vs transformers, float32
    assert "| rms_norm | float32 | reference |" in report


def test_a_wrong_op_is_reported_as_a_failure():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import device_check

    from slime.accelerator import get_accelerator

    real = get_accelerator()

    class PoisonedOps:
        def source(self, name):
            return "poisoned"

        def __getattr__(self, name):
            fn = getattr(real.ops, name)
            return (lambda x, w, eps: fn(x, w, eps) * 1.001) if name == "rms_norm" else fn

    class Acc:
        name, ops = "cpu", PoisonedOps()
        device, synchronize = staticmethod(real.device), staticmethod(real.synchronize)

    args = type("A", (), dict(size="tiny", dry_run=False, ops="rms_norm,swiglu"))()
    s = device_check.Section("ops")
    device_check.run_ops(Acc(), s, args)
    assert [f.split(":")[0] for f in s.failures] == ["rms_norm bfloat16", "rms_norm float32"] or \
        [f.split(":")[0] for f in s.failures] == ["rms_norm float32"], s.failures
    assert any("**FAIL**" in line and "| rms_norm | float32 |" in line for line in s.lines)
    assert not any("| swiglu |" in line and "FAIL" in line for line in s.lines)


@pytest.mark.device
def test_device_report_on_the_real_device(tmp_path):
    if torch.accelerator.current_accelerator() is None:
        pytest.skip("no accelerator")
    r = _run("--out", str(tmp_path), "--sections", "ops,ipc,collective", timeout=900)
    assert r.returncode == 0, (tmp_path / "device-report.md").read_text()
