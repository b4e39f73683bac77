"""GLM-5.3-Flash's KDA ops on the Ascend provider (slime/accelerator/ascend/kda_ops.py) under the torch_npu /
sgl_kernel_npu simulators (tests/npu_sim: the documented contracts in float64 torch, not hardware).

Tolerances: bfloat16 tokens |out - float64 reference| <= 2e-2 + 2e-2 |ref| (a few bfloat16 roundings); float32
gate inputs 1e-6 relative to max |ref|. The mapped backward is the reference's autograd on a recompute, so grads
equal the reference op's grads in the same dtype to 1e-6 (float32) and within the bfloat16 bound to float64."""

from __future__ import annotations

import argparse

import pytest
import torch

from slime.accelerator.ascend import kda_ops
from slime.accelerator.ops import kda as ref

npu_sim = pytest.importorskip("npu_sim")
F64 = torch.float64


def cu(*lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _calls(op: str) -> int:
    return kda_ops.KERNEL_CALLS.get(op, 0)


@pytest.fixture
def a3():
    with npu_sim.activate(reuse_probes=True) as acc:
        yield acc


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_kernel_equals_the_reference_forward_and_backward(a3, lower_bound):
    assert a3.ops.source("kda_gate").startswith("sgl_kernel_npu.fla.kda_gate.fused_kda_gate_npu")
    g = torch.Generator().manual_seed(3)
    f = (torch.randn(13, 3, 8, generator=g) * 8).requires_grad_()  # past softplus's threshold 20 too
    a_log = torch.randn(3, generator=g).requires_grad_()
    dt_bias = torch.randn(24, generator=g).requires_grad_()
    before = _calls("kda_gate")
    out = a3.ops.kda_gate(f, a_log, dt_bias, lower_bound)
    assert _calls("kda_gate") == before + 1 and out.dtype == torch.float32 and out.shape == f.shape
    leaves64 = [t.detach().double().requires_grad_() for t in (f, a_log, dt_bias)]
    want = ref.kda_gate(*leaves64, lower_bound)
    scale = want.abs().max().item()
    torch.testing.assert_close(out.double(), want, atol=1e-6 * scale, rtol=0)
    cot = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * cot).sum(), (f, a_log, dt_bias))
    grads32 = torch.autograd.grad((ref.kda_gate(f, a_log, dt_bias, lower_bound) * cot).sum(), (f, a_log, dt_bias))
    grads64 = torch.autograd.grad((want * cot.double()).sum(), leaves64)
    for ours, same_dtype, exact in zip(grads, grads32, grads64):
        torch.testing.assert_close(ours, same_dtype, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.double(), exact, atol=1e-5 * exact.abs().max().item(), rtol=0)


@pytest.mark.parametrize("width", [4, 3, 2])
def test_causal_conv1d_kernel_equals_the_reference_forward_and_backward(a3, width):
    lengths = (5, 0, 1, 3, 12)  # an empty and a one-token sequence among packed ones
    g = torch.Generator().manual_seed(width)
    x = torch.randn(sum(lengths), 64, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(64, width, generator=g).requires_grad_()  # float32, as the model keeps it
    before = _calls("causal_conv1d")
    out = a3.ops.causal_conv1d(x, weight, cu(*lengths), "silu")
    assert _calls("causal_conv1d") == before + 1 and out.dtype == torch.bfloat16
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = ref.causal_conv1d(x64, w64, cu(*lengths), "silu")
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    cot = torch.randn(out.shape, generator=g)
    gx, gw = torch.autograd.grad((out.float() * cot).sum(), (x, weight))
    rx, rw = torch.autograd.grad((want * cot.double()).sum(), (x64, w64))
    torch.testing.assert_close(gx.double(), rx, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(gw.double(), rw, atol=5e-2 * rw.abs().max().item(), rtol=0)


def test_inputs_the_conv_kernel_does_not_take_run_the_reference(a3):
    before = _calls("causal_conv1d")
    x = torch.randn(7, 16)  # float32 tokens: the kernel takes bfloat16 / float16 only
    out = a3.ops.causal_conv1d(x, torch.randn(16, 4), cu(3, 4), "silu")
    wide = a3.ops.causal_conv1d(x.bfloat16(), torch.randn(16, 5), cu(3, 4), "silu")  # width 5: kernel takes 2..4
    assert _calls("causal_conv1d") == before and out.dtype == torch.float32 and wide.dtype == torch.bfloat16


def test_contract_violations_fail_loudly():
    with npu_sim.activate():
        conv = torch.ops.npu.causal_conv1d
        x = torch.randn(6, 64, dtype=torch.bfloat16)
        states = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
        qsl = torch.tensor([0, 2, 6])
        with pytest.raises(RuntimeError, match="width in \\[2,4\\]"):  # [C, K]: slime's layout, untransposed
            conv(x, torch.randn(64, 4, dtype=torch.bfloat16), states, query_start_loc=qsl)
        with pytest.raises(RuntimeError, match="Only BF16 and FP16"):
            conv(x.float(), torch.randn(4, 64), states.float(), query_start_loc=qsl)
        with pytest.raises(RuntimeError, match="weight must be \\[width, dim\\]"):  # channels differ from x's
            conv(x, torch.randn(4, 32, dtype=torch.bfloat16), states, query_start_loc=qsl)
        with pytest.raises(RuntimeError):  # an argument the schema does not have: torch.ops refuses it
            conv(x, torch.randn(4, 64, dtype=torch.bfloat16), states, query_start_loc=qsl, layout="TND")
        from sgl_kernel_npu.fla.kda_gate import fused_kda_gate_npu

        with pytest.raises(ValueError, match="does not match A_log and head_dim"):
            fused_kda_gate_npu(torch.randn(4, 24), torch.randn(3), 16)
    with npu_sim.activate(soc="950PR"):
        with pytest.raises(RuntimeError, match="not registered: sgl-kernel-npu's Ascend950 build"):
            torch.ops.npu.causal_conv1d(x, torch.randn(4, 64, dtype=torch.bfloat16), states, query_start_loc=qsl)


def test_the_950_table_says_which_ops_run_the_reference_and_why(caplog):
    with npu_sim.activate(soc="950PR", reuse_probes=True) as acc:
        with caplog.at_level("WARNING"):
            sources = {op: acc.ops.source(op) for op in kda_ops.OPS}
    assert sources["kda"] == "reference" and sources["causal_conv1d"] == "reference"
    assert sources["kda_gate"].startswith("sgl_kernel_npu.fla.kda_gate.fused_kda_gate_npu")
    text = caplog.text
    assert "built for A2/A3 only" in text or "causal_conv1d" not in text  # logged once per process


def test_an_older_sgl_kernel_npu_is_refused_by_version(monkeypatch):
    monkeypatch.setattr(npu_sim.fake_sgl_kernel_npu, "__version__", "2026.8.1")
    with npu_sim.activate() as acc:
        assert acc.ops.source("kda_gate") == "reference"  # fused_kda_gate_npu is in 2026.8.10 on
        assert acc.ops.source("causal_conv1d") != "reference"  # in 2026.03.31.rc2 on
    assert kda_ops._version_key("2026.03.31.rc2") < kda_ops._version_key("2026.03.31") < kda_ops._version_key("20260821")


def test_kda_layer_ops_forward_backward_on_the_simulated_npu_and_the_check(a3, monkeypatch):
    """The KDA token mixer's op chain (conv -> gate -> kda) in bfloat16 on the simulated NPU equals the reference
    table's; the op table names each op's implementation; removing fused_kda_gate_npu makes
    --require-device-kernels name kda_gate."""
    from slime.config.device_kernels import check_device_kernels
    from slime.config.preflight_report import PreflightError

    g = torch.Generator().manual_seed(0)
    lengths, heads, dim = (9, 4), 2, 64
    qkv = torch.randn(sum(lengths), 3 * heads * dim, generator=g).bfloat16().requires_grad_()
    conv_w = (torch.randn(3 * heads * dim, 4, generator=g) * 0.5).requires_grad_()
    f = torch.randn(sum(lengths), heads, dim, generator=g).bfloat16().requires_grad_()
    a_log, dt_bias = torch.randn(heads, generator=g), torch.randn(heads * dim, generator=g)
    beta = torch.rand(sum(lengths), heads, generator=g).bfloat16()

    def chain(ops):
        q, k, v = ops.causal_conv1d(qkv, conv_w, cu(*lengths), "silu").view(-1, 3 * heads, dim).chunk(3, 1)
        decay = ops.kda_gate(f, a_log, dt_bias, -5.0)
        return ops.kda(q, k, v, decay, beta, cu(*lengths))

    from slime.accelerator.ops import build_op_table

    out = chain(a3.ops)
    grads = torch.autograd.grad(out.float().square().sum(), (qkv, conv_w, f))
    want = chain(build_op_table(a3, env="reference"))
    want_grads = torch.autograd.grad(want.float().square().sum(), (qkv, conv_w, f))
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    for ours, theirs in zip(grads, want_grads):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2 * theirs.abs().max().item(), rtol=0)

    args = argparse.Namespace(hf_config={"model_type": "glm5_next"}, require_device_kernels=True)
    with pytest.raises(PreflightError) as before:
        check_device_kernels(args, a3)
    assert "kda_gate" not in str(before.value) and "causal_conv1d" not in str(before.value)
    monkeypatch.delattr(npu_sim.fake_sgl_kernel_npu.fla.kda_gate, "fused_kda_gate_npu")
    with npu_sim.activate() as fresh:
        with pytest.raises(PreflightError, match=r"would run .*kda_gate.* on the pure-torch reference"):
            check_device_kernels(args, fresh)
