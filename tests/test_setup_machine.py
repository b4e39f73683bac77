"""scripts/setup-venv.sh's choice per machine, on faked machines (a fake nvidia-smi on PATH, a fake CANN
set_env.sh, neither): the constraint file it picks, and that a venv whose torch is built for an accelerator is
used as is (no pip run). Nothing is installed: --print-plan stops after the choice, and the one full run goes
down the use-as-is path, which installs nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "scripts", "setup-venv.sh")


def _machine(tmp_path, kind: str) -> dict:
    """The environment of a faked machine: PATH without any real nvidia-smi / npu-smi, plus a fake one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    ascend = tmp_path / "Ascend"
    if kind == "cuda":
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    if kind == "npu":
        (ascend / "ascend-toolkit").mkdir(parents=True)
        (ascend / "ascend-toolkit" / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=/nowhere\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIME_", "ASCEND_"))}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", SLIME_ASCEND_ROOT=str(ascend), SLIME_VENV=str(tmp_path / "venv"))
    return env


def _fake_venv(tmp_path, torch_version: str | None, extra_dists=(), python: str = sys.executable) -> str:
    """A venv whose python is this interpreter with a site directory holding only distribution metadata (a fake
    torch of `torch_version`), first on its path; it logs every call, so a pip run would show."""
    site = tmp_path / "venv" / "site"
    for name, version in ([("torch", torch_version)] if torch_version else []) + list(extra_dists):
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    site.mkdir(parents=True, exist_ok=True)
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    log = tmp_path / "venv" / "calls.log"
    py.write_text(f'#!/bin/sh\necho "$*" >> {log}\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {python} "$@"\n')
    py.chmod(0o755)
    return str(log)


def _setup(env, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SETUP, *flags], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"])
def test_the_machine_picks_its_constraint_file(tmp_path, kind):
    r = _setup(_machine(tmp_path, kind), "--print-plan")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"setup: {kind} machine"), lines
    assert f"constraints/{kind}.txt" in lines[0]
    pins = {"cpu": "torch 2.13.0", "cuda": "torch 2.14.1", "npu": "torch 2.12.0 + torch-npu 2.12.0"}
    assert pins[kind] in lines[0]
    assert not (tmp_path / "venv").exists()  # nothing created


def test_the_detection_function_alone(tmp_path):
    lib = os.path.join(ROOT, "scripts", "lib", "machine.sh")
    for kind in ("cpu", "cuda", "npu"):
        env = _machine(tmp_path / kind, kind)
        r = subprocess.run(["bash", "-c", f'source "{lib}"; slime_detect_machine; slime_constraints_for '
                            '"$(slime_detect_machine)"'], env=env, capture_output=True, text=True)
        assert r.stdout.split() == [kind, os.path.join(ROOT, "constraints", f"{kind}.txt")], (kind, r.stderr)
        assert os.path.isfile(r.stdout.split()[1])
    env = _machine(tmp_path / "override", "cpu") | {"SLIME_MACHINE": "gpu"}
    r = subprocess.run(["bash", "-c", f'source "{lib}"; slime_detect_machine'], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "use cpu, cuda or npu" in r.stderr


@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("torch_version, extra, build", [
    ("2.14.1+cu129", (), "cuda"),
    ("2.14.1", (("nvidia-cuda-runtime-cu12", "12.9.79"),), "cuda"),  # PyPI's unlabelled Linux wheel
    ("2.12.0+cpu", (("torch-npu", "2.12.0"),), "npu"),
])
def test_an_accelerator_torch_is_never_replaced(tmp_path, kind, torch_version, extra, build):
    env = _machine(tmp_path, kind)
    log = _fake_venv(tmp_path, torch_version, extra)
    r = _setup(env, "--print-plan")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"setup: {kind} machine ({_why(kind)}); {tmp_path}/venv already has torch {torch_version} ({build} build): "
        "using it as is, installing nothing"]
    r = _setup(env)  # the full set-up: still uses it as is (its stand-in python has megatron-core, ray, ...)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = open(log).read()
    assert "pip" not in calls and " venv " not in calls, calls
    assert not (tmp_path / "venv" / ".slime-installed").exists()


def test_a_cpu_torch_on_a_gpu_machine_is_upgraded_and_use_existing_keeps_it(tmp_path):
    env = _machine(tmp_path, "cuda")
    _fake_venv(tmp_path, "2.13.0+cpu")
    r = _setup(env, "--print-plan")
    assert "constraints/cuda.txt, torch 2.14.1" in r.stdout  # a CPU torch on a GPU machine is not kept
    r = _setup(env, "--print-plan", "--use-existing")
    assert "already has torch 2.13.0+cpu (cpu build): using it as is" in r.stdout


def test_use_existing_without_torch_is_one_line_exit_2(tmp_path):
    env = _machine(tmp_path, "cuda")
    _fake_venv(tmp_path, None, python=os.path.join(sys.base_prefix, "bin", "python3"))  # an interpreter without torch
    r = _setup(env, "--use-existing")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "has no torch" in r.stderr


def _why(kind: str) -> str:
    return {"cpu": "no nvidia-smi, no Ascend CANN", "cuda": "nvidia-smi found", "npu": "Ascend CANN found"}[kind]


def test_cluster_dry_run_uses_the_project_venv_without_python_set(tmp_path):
    """docs/ascend.md's `SLIME_PROFILE=npu bash scripts/run-glm5.3-flash-300B.sh --dry-run` with no PYTHON and a
    python3 on PATH that has no torch: the script takes the project's venv."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(os.path.join(sys.base_prefix, "bin", "python3"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHON" and not k.startswith("SLIME_")}
    env.update(SLIME_PROFILE="npu", SLIME_VENV=os.path.dirname(os.path.dirname(sys.executable)), RAY_AUTH_MODE="disabled")
    env["PATH"] = f"{bare}:/usr/bin:/bin"  # python3 is the bare interpreter; the venv is found through SLIME_VENV
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run-glm5.3-flash-300B.sh"), "--dry-run"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "dry run OK" in r.stdout and f"-- {sys.executable} train.py" in r.stdout
