"""The recorded facts of the KDA / mHC kernels (tests/data/npu_kda_facts.json: sgl-kernel-npu's sources at tag
2026.08.21, SGLang 0.5.23's wheel, the torch-npu wheels 2.7.1 .. 2.14.0; read, never run) against the simulator
(tests/npu_sim/sgl_kernel_npu) and slime's Ascend KDA mappings (slime/accelerator/ascend/kda_ops.py)."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from slime.accelerator.ascend import kda_ops

npu_sim = pytest.importorskip("npu_sim")
FACTS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "npu_kda_facts.json"), encoding="utf-8"))
SGL = FACTS["sgl_kernel_npu"]


def _schema_names(schema: str) -> list[str]:
    inner = schema[schema.index("(") + 1: schema.rindex(") ->")]
    return [a.split("=")[0].split()[-1] for a in inner.split(",") if a.strip() and a.strip() != "*"]


def test_the_simulated_conv_has_sgl_kernel_npus_schema_and_slime_passes_only_its_arguments(monkeypatch):
    assert npu_sim.fake_sgl_kernel_npu.SCHEMA == SGL["causal_conv1d"]["schema"]
    names = _schema_names(SGL["causal_conv1d"]["schema"])
    for call in FACTS["sglang_0.5.23_calls"]["torch.ops.npu.causal_conv1d"]:  # SGLang's calls fit it too
        assert set(call) <= set(names)
    seen = {}
    monkeypatch.setitem(kda_ops.KERNELS, "causal_conv1d", lambda: lambda *a, **k: seen.update(n=len(a), kw=k) or a[0])
    kda_ops._conv_on_kernel(torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(8, 4), torch.tensor([0, 2, 5]), "silu")
    assert set(seen["kw"]) <= set(names[seen["n"]:])


def test_the_conv_is_a3_only_and_kda_has_no_published_kernel():
    assert SGL["causal_conv1d"]["registered_under"] == ["#ifdef SGL_KERNEL_ENABLE_A3_ONLY_OPS"]
    assert SGL["causal_conv1d"]["a3_only_ops_off_for_ascend950"]
    assert kda_ops.MAPPINGS["causal_conv1d"].socs == ("A2", "A3")
    assert not SGL["chunk_kda_fwd_defined"] and "kda" in kda_ops.NO_KERNEL
    assert FACTS["sglang_0.5.23_calls"]["torch.ops.npu.chunk_kda_fwd"]  # what SGLang calls (forward only)
    assert all(op not in FACTS["torch_npu"] or "kda" not in op for op in FACTS["torch_npu"])


def test_the_simulated_gate_has_sgl_kernel_npus_signature():
    from npu_sim.sgl_kernel_npu.fla.kda_gate import fused_kda_gate_npu

    recorded = [p.split(":")[0].strip() for p in SGL["fused_kda_gate_npu"]["signature"].split(",") if p.strip()]
    ours = []
    for p in inspect.signature(fused_kda_gate_npu).parameters.values():
        if p.kind == p.KEYWORD_ONLY and "*" not in ours:
            ours.append("*")
        ours.append(p.name)
    assert ours == recorded  # names, order and the keyword-only split
    for call in FACTS["sglang_0.5.23_calls"]["fused_kda_gate_npu"]:
        assert set(call) <= set(inspect.signature(fused_kda_gate_npu).parameters)
    assert kda_ops.MAPPINGS["kda_gate"].since == SGL["fused_kda_gate_npu"]["first_tag"].split()[0]
    assert kda_ops.MAPPINGS["causal_conv1d"].since == SGL["causal_conv1d"]["first_tag"].split()[0]


def test_torch_npu_has_mhc_with_backward_and_k3_convs_only_in_the_wheels_read():
    tn = FACTS["torch_npu"]
    for op in ("npu_mhc_pre", "npu_mhc_post", "npu_mhc_sinkhorn"):
        assert tn[op]["wheels"][0] == "2.7.1.post4" and tn[op]["backward_2.14.0"]  # Ascend PyTorch 26.0.0 on
    assert not tn["npu_clipped_swiglu"]["backward_2.14.0"]  # forward only: not a training mapping
    assert "2.14.0" in tn["npu_masked_causal_conv1d"]["wheels"] and tn["npu_masked_causal_conv1d"]["backward_2.14.0"]
