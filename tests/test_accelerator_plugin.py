"""An out-of-tree accelerator in one package: a throw-away CPU-backed "cpu2" with its own op provider and an
empty patch set, found through the `slime.accelerators` entry-point group and selected with
SLIME_ACCELERATOR=cpu2; it runs an op and a one-rank collective through the interface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from slime.accelerator import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGE = {
    "slime_cpu2/__init__.py": '''
        from slime.accelerator import CpuAccelerator


        class Cpu2Accelerator(CpuAccelerator):
            name = "cpu2"
            op_provider = "slime_cpu2.ops"
            patch_sets = {}  # megatron-core and transformers run unpatched on this device
    ''',
    "slime_cpu2/ops.py": '''
        import torch

        from slime.accelerator.ops import DeviceOp

        CALLS = []


        def rms_norm(x, weight, eps=1e-6):
            CALLS.append(tuple(x.shape))
            scale = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
            y = (x.float() * scale).to(x.dtype)
            return y if weight is None else weight * y


        def resolve(op_name, acc):
            return DeviceOp(rms_norm, "slime_cpu2.ops.rms_norm") if op_name == "rms_norm" else None
    ''',
    "slime_cpu2-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: slime-cpu2\nVersion: 0.1\n",
    "slime_cpu2-0.1.dist-info/entry_points.txt": "[slime.accelerators]\ncpu2 = slime_cpu2:Cpu2Accelerator\n",
}

CHILD = '''
import json, os, torch, torch.distributed as dist
from slime.accelerator import get_accelerator
from slime.accelerator.patches import patch_set
from slime.utils.net import free_port
import slime_cpu2.ops

acc = get_accelerator()
out = {"name": acc.name, "module": type(acc).__module__, "source": acc.ops.source("rms_norm"),
       "attention": acc.ops.source("attention"), "patches": acc.apply_patches("megatron"),
       "declared": patch_set("cpu2", "transformers")}
g = torch.Generator().manual_seed(5)
x = torch.randn(3, 5, 37, generator=g) * 4
w = torch.rand(37, generator=g) + 0.5
y = acc.ops.rms_norm(x, w, 1e-5)
x64, w64 = x.double(), w.double()
ref = w64 * x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-5)
out["rms_err"] = float(((y.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max())
out["provider_calls"] = len(slime_cpu2.ops.CALLS)
dist.init_process_group(acc.process_group_backend(), init_method=f"tcp://127.0.0.1:{free_port()}",
                        world_size=1, rank=0)
t = torch.arange(6, dtype=torch.float32, device=acc.device()) - 2.5
s = t.clone()
dist.all_reduce(s)
gathered = [torch.empty_like(t)]
dist.all_gather(gathered, t * 3)
out["all_reduce_ok"] = bool(torch.equal(s, t)) and bool(torch.equal(gathered[0], t * 3))
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture
def cpu2_path(tmp_path):
    for rel, text in PACKAGE.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return str(tmp_path)


def _run_child(path: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("SLIME_ACCELERATOR", "SLIME_ACCELERATOR_PLUGINS")}
    environ.update(PYTHONPATH=os.pathsep.join([path, REPO]), **env)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_out_of_tree_accelerator_selected_by_name_runs_an_op_and_a_collective(cpu2_path):
    out = _run_child(cpu2_path, SLIME_ACCELERATOR="cpu2")
    assert out["name"] == "cpu2" and out["module"] == "slime_cpu2"
    assert out["source"] == "slime_cpu2.ops.rms_norm" and out["provider_calls"] == 1  # its op ran
    assert out["attention"] == "reference"  # what the provider does not implement falls back
    assert out["rms_err"] <= 1e-6  # float32 against the float64 formula
    assert out["patches"] == [] and out["declared"] == []  # the empty patch set: nothing applied
    assert out["all_reduce_ok"]


def test_broken_entry_point_is_one_line_naming_it(monkeypatch):
    bad = types.SimpleNamespace(name="musa", value="slime_musa:MusaAccelerator",
                                load=lambda: (_ for _ in ()).throw(ImportError("libmusa.so: not found")))
    not_a_class = types.SimpleNamespace(name="odd", value="odd:thing", load=lambda: 42)
    import importlib.metadata as md

    for ep, words in ((bad, "failed to load (ImportError: libmusa.so: not found)"), (not_a_class, "not an Accelerator")):
        monkeypatch.setattr(md, "entry_points", lambda group, ep=ep: [ep] if group == registry.ENTRY_POINT_GROUP else [])
        with pytest.raises(registry.AcceleratorUnavailable) as e:
            registry.load_entry_points()
        msg = str(e.value)
        assert "\n" not in msg and repr(ep.name) in msg and words in msg


def test_entry_point_function_returning_none_registers_nothing(monkeypatch):
    import importlib.metadata as md

    ep = types.SimpleNamespace(name="absent", value="pkg:maybe", load=lambda: (lambda: None))
    monkeypatch.setattr(md, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else [])
    before = registry.accelerator_names()
    registry.load_entry_points()
    assert registry.accelerator_names() == before
