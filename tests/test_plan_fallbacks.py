"""The planner counts the memory of ops that run on the pure-torch reference (slime/plan/fallbacks.py): which ops fall
back per Ascend SoC (equal to the op table the simulated NPU builds), and what each reference keeps for backward
(its formula against the bytes saved-tensor hooks see on CPU), and GLM-5.3-Flash's plan on the 950 with them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slime.accelerator.ops import kda as kda_ops
from slime.accelerator.ops import reference
from slime.plan import Layout, ModelShape, TrainSettings, get_device, plan
from slime.plan import fallbacks


def _kept_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd saves for backward that are not the inputs themselves."""
    seen, given = {}, {t.untyped_storage().data_ptr() for t in inputs if torch.is_tensor(t)}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in given:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def _leaf(*shape, scale=1.0, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_(True)


def test_which_ops_fall_back_per_device():
    npu = {key: set(fallbacks.fallback_ops(key, "glm5_next")) for key in ("950dt", "950pr", "a3")}
    assert {"kda", "kpool_indexer"} <= npu["a3"] and not {"causal_conv1d", "attention", "rms_norm"} & npu["a3"]
    assert {"kda", "causal_conv1d", "rms_norm", "moe_route"} <= npu["950dt"]  # A2/A3-only kernels
    assert "sparse_attention" not in npu["950dt"] and "sparse_attention" in npu["950pr"]  # fusion attention: 950DT
    assert "kda_gate" not in npu["950pr"] and "token_log_probs" not in npu["950pr"]
    assert fallbacks.fallback_ops("h200", "glm5_next") == () and fallbacks.fallback_ops("950dt", "glm_moe_dsa")


@pytest.mark.parametrize("key,soc", [("950dt", "950DT"), ("950pr", "950PR"), ("a3", "A3")])
def test_the_planners_fallbacks_are_the_simulated_op_table(key, soc):
    npu_sim = pytest.importorskip("npu_sim")
    from slime.accelerator import op_report

    with npu_sim.activate(soc=soc, reuse_probes=True) as acc:
        rows = op_report.op_rows(acc.ops, op_report.model_ops("glm5_next"))
    assert set(op_report.fallbacks(rows)) == set(fallbacks.fallback_ops(key, "glm5_next"))


@pytest.mark.parametrize("tokens,heads,dk,dv", [(256, 2, 128, 128), (384, 3, 64, 32)])
def test_kda_reference_formula(tokens, heads, dk, dv):
    q, k = _leaf(tokens, heads, dk), _leaf(tokens, heads, dk, seed=1)
    v, g = _leaf(tokens, heads, dv, seed=2), (-_leaf(tokens, heads, dk, seed=3).detach().abs() * 0.1).requires_grad_()
    beta = torch.rand(tokens, heads).to(torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)  # two sequences of whole chunks
    measured = _kept_bytes(kda_ops.kda, q, k, v, g, beta, cu)
    planned = tokens * heads * fallbacks.kda_reference_floats(dk, dv, kda_ops.CHUNK) * fallbacks.F32
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)


@pytest.mark.parametrize("taps", [3, 4])
def test_conv_and_norm_reference_formulas(taps):
    x, w = _leaf(300, 96), torch.randn(96, taps, requires_grad=True)
    measured = _kept_bytes(kda_ops.causal_conv1d, x, w, torch.tensor([0, 100, 300], dtype=torch.int32))
    assert abs(fallbacks.conv_reference_floats(300 * 96, taps) * fallbacks.F32 - measured) <= 0.02 * measured
    x, w = _leaf(300, 512), _leaf(512, seed=5)
    extra = _kept_bytes(reference.rms_norm, x, w, 1e-6) - x.numel() * 2  # the bf16 output the kernel keeps too
    assert abs(extra - x.numel() * fallbacks.F32) <= 0.02 * extra


@pytest.mark.parametrize("op", ["attention", "sparse_attention"])
def test_attention_reference_formula(op, monkeypatch):
    heads, s, d = 4, 384, 64
    q, k, v = _leaf(s, heads, d), _leaf(s, heads, d, seed=1), _leaf(s, heads, d, seed=2)
    cu = torch.tensor([0, s], dtype=torch.int32)
    extra = (torch.randint(0, s, (s, 16), dtype=torch.int32),) if op == "sparse_attention" else ()
    fn = getattr(reference, op)
    measured = _kept_bytes(fn, q, k, v, *extra, cu, cu, True)
    planned = s * fallbacks.attention_reference_bytes(op, heads, d, d, tokens=s)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
    # above the blocking limit only the float32 q / k / v copies stay
    monkeypatch.setattr("slime.accelerator.ops.blocked_attention.SCORE_ELEMENTS_LIMIT", 1000)
    measured = _kept_bytes(fn, q, k, v, *extra, cu, cu, True)
    planned = s * fallbacks.attention_reference_bytes(op, heads, d, d, tokens=s)
    assert planned < s * heads * 3 * d * fallbacks.F32 * 1.2 and abs(planned - measured) <= 0.25 * measured


def test_the_950_plan_counts_the_fallbacks():
    model, device = ModelShape.from_config("glm5.3-flash"), get_device("950dt")
    layout = Layout(16, 8, tp=8, pp=2, ep=32, cp=1, etp=1)
    ts = TrainSettings(max_tokens_per_gpu=4096, recompute="none", with_mtp=False)
    honest, kernels_assumed = plan(model, layout, device, ts), plan(model, layout, device, replace(ts, fallback_ops=()))
    assert honest.train.fallback_ops == fallbacks.fallback_ops("950dt", "glm5_next")
    stage = max(honest.stages, key=lambda m: m.total).stage
    from slime.plan.memory import stage_params, tokens_per_device

    sp = stage_params(model, layout.pp, stage, with_mtp=False)
    t = tokens_per_device(layout, honest.train)  # the longest sample (2048 + 8192) is a micro-batch of its own
    per_token = sp.linear_layers * fallbacks.layer_bytes(model, layout, honest.train, t, linear=True) + \
        (sp.dense_layers + sp.moe_layers - sp.linear_layers) * fallbacks.layer_bytes(model, layout, honest.train, t,
                                                                                     linear=False)
    in_flight = honest.stages[stage].micro_batches_in_flight
    growth = honest.stages[stage].activations - kernels_assumed.stages[stage].activations
    assert growth == pytest.approx(per_token * t * in_flight, rel=1e-9) and growth > 50e9  # KDA's chunk terms
    assert not honest.fits and kernels_assumed.fits  # without recompute the 950DT layout does not fit
    assert plan(model, layout, device, replace(ts, recompute="full")).fits  # scripts/profiles/npu.sh recomputes
    from slime.plan.report import plan_text

    assert "counts the reference's memory of" in plan_text(honest) and "kda" in plan_text(honest)
