"""The Ascend op probes compare each kernel with the float64 reference at run time, per mode, and a failing
mode keeps the reference with one log line naming the op, the mode and the difference. Checked against the
SIMULATED torch_npu (tests/npu_sim; documented contracts, not hardware), including kernels made finite but
wrong on purpose (torch_npu.simulate_defects)."""

from __future__ import annotations

import logging

import pytest
import torch

npu_sim = pytest.importorskip("npu_sim")

from slime.accelerator.ascend import ops as npu_ops  # noqa: E402
from slime.accelerator.ascend import probes  # noqa: E402
from slime.accelerator.ops import build_op_table, reference  # noqa: E402

LOGGER = "slime.accelerator.ops"


@pytest.fixture(autouse=True)
def _fresh_log_once(monkeypatch):
    from slime.accelerator import ops

    monkeypatch.setattr(ops, "_LOGGED", set())


def _lines(caplog, *words):
    return [r.getMessage() for r in caplog.records if all(w in r.getMessage() for w in words)]


def test_every_mapping_and_mode_passes_its_probe_on_the_simulator(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with npu_sim.activate() as acc:
        sources = build_op_table(acc).sources()
        assert npu_ops._PROBED and not any(npu_ops._PROBED.values()), npu_ops._PROBED
    assert {k for k in npu_ops.MAPPINGS if sources[k] == "reference"} == set(), sources
    assert not _lines(caplog, "probe"), caplog.text
    assert set(probes.modes("apply_rotary")) == {"half", "interleave"}


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_runs_the_kernel_in_both_modes(interleaved):
    """[T, H, D] goes to npu_rotary_mul as BSND with 1S1D cos/sin; partial rotary_dim; float64 reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 40, generator=g, dtype=torch.float64).to(torch.bfloat16)
    cos, sin = torch.randn(7, 16, generator=g).to(torch.bfloat16), torch.randn(7, 16, generator=g).to(torch.bfloat16)
    with npu_sim.activate() as acc:
        assert npu_ops.resolve("apply_rotary", acc).source == "torch_npu.npu_rotary_mul"
        before = npu_ops.KERNEL_CALLS.get("npu_rotary_mul", 0)
        out = npu_ops.apply_rotary(x, cos, sin, 32, interleaved)
        assert npu_ops.KERNEL_CALLS["npu_rotary_mul"] == before + 1
    want = reference.apply_rotary(x.double(), cos.double(), sin.double(), 32, interleaved)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(out[..., 32:], x[..., 32:])


def test_indexer_reading_key_lengths_as_prefix_sums_is_caught():
    """A kernel that takes actual_seq_lengths_key as cumulative ends: no error, finite indices, wrong keys
    for the second sequence. The probe (two sequences of unequal length) sees it; the reference is kept."""
    defect = "npu_lightning_indexer:key_lengths_as_prefix_sums"
    with npu_sim.activate(defects=(defect,)) as acc:
        import torch_npu

        q = torch.randn(8, 8, 128).to(torch.bfloat16)
        k = torch.randn(8, 1, 128).to(torch.bfloat16)
        w = torch.randn(8, 8).to(torch.bfloat16)
        kw = dict(actual_seq_lengths_query=torch.tensor([3, 8], dtype=torch.int32), layout_query="TND",
                  layout_key="TND", sparse_count=2)
        wrong = torch_npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_key=torch.tensor([3, 5], dtype=torch.int32), **kw)[0]
        assert bool((wrong >= -1).all())  # finite, in range: only the numbers are wrong
        why = probes.probe("lightning_indexer", npu_ops.lightning_indexer, acc.device(), npu_ops.KERNEL_CALLS,
                           "npu_lightning_indexer", "TND")
        assert "selected keys differs from the reference" in why, why


def test_a_wrong_kernel_falls_back_with_one_line_naming_op_mode_and_difference(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with npu_sim.activate(defects=("npu_lightning_indexer:key_lengths_as_prefix_sums",)) as acc:
        table = build_op_table(acc)
        assert table.source("lightning_indexer") == "reference"
        g = torch.Generator().manual_seed(5)
        q, k = torch.randn(8, 8, 128, generator=g).bfloat16(), torch.randn(8, 128, generator=g).bfloat16()
        w, cu = torch.randn(8, 8, generator=g).bfloat16(), torch.tensor([0, 3, 8], dtype=torch.int32)
        torch.testing.assert_close(table.lightning_indexer(q, k, w, cu, cu, 2), reference.lightning_indexer(q, k, w, cu, cu, 2))
    lines = _lines(caplog, "ops[npu].lightning_indexer")
    assert len(lines) == 1, lines
    assert "npu_lightning_indexer (mode TND)" in lines[0] and "differs from the reference by up to" in lines[0]


def test_sparse_flash_attention_misreading_kv_lengths_keeps_the_per_sequence_kernel(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with npu_sim.activate(defects=("npu_sparse_flash_attention:kv_lengths_as_prefix_sums",)) as acc:
        assert npu_ops.resolve("sparse_attention", acc).source == "torch_npu.npu_fusion_attention"
        assert not npu_ops._SFA_OK[0]
    lines = _lines(caplog, "npu_sparse_flash_attention (mode absorbed MLA, TND)")
    assert len(lines) == 1 and "differs from the reference by up to" in lines[0], caplog.text


def test_a_failing_rotary_mode_uses_the_reference_and_the_other_mode_keeps_the_kernel(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    x, cos, sin = torch.randn(5, 2, 16).bfloat16(), torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    with npu_sim.activate(defects=("npu_rotary_mul:interleave_as_half",)) as acc:
        rotary = npu_ops.resolve("apply_rotary", acc)
        assert rotary.source == "torch_npu.npu_rotary_mul"
        before = npu_ops.KERNEL_CALLS.get("npu_rotary_mul", 0)
        out = rotary.fn(x, cos, sin, None, True)
        assert npu_ops.KERNEL_CALLS.get("npu_rotary_mul", 0) == before  # interleave: the reference
        torch.testing.assert_close(out, reference.apply_rotary(x, cos, sin, None, True))
        rotary.fn(x, cos, sin, None, False)
        assert npu_ops.KERNEL_CALLS["npu_rotary_mul"] == before + 1  # half: the kernel
    lines = _lines(caplog, "ops[npu].apply_rotary")
    assert len(lines) == 1 and "(mode interleave)" in lines[0] and "differs from the reference" in lines[0], lines


def test_probe_tolerance_passes_rounding_and_catches_a_scaled_result(monkeypatch):
    with npu_sim.activate() as acc:
        import torch_npu

        real = torch_npu.npu_swiglu
        for factor, ok in ((1.0, True), (1.004, True), (1.2, False)):
            monkeypatch.setattr(torch_npu, "npu_swiglu", lambda x, dim=-1, f=factor: real(x, dim=dim) * f)
            why = probes.probe("swiglu", npu_ops.swiglu, acc.device(), npu_ops.KERNEL_CALLS, "npu_swiglu")
            assert (why == "") == ok, (factor, why)
        assert "output differs from the reference by up to" in why


@pytest.mark.parametrize("release,dw_kernel", [("7.3.0", False), ("26.1.0", True)])
def test_grouped_matmul_dw_by_group_type_2_only_where_the_release_has_it(release, dw_kernel):
    """group_type 2 is undocumented; the meta registration takes it from the 26.0.0 wheels on (the simulator
    refuses it before). Either way dw equals the float64 reference."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 6, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(3, 6, 4, generator=g).bfloat16().requires_grad_(True)
    counts = torch.tensor([3, 0, 4])
    with npu_sim.activate(release=release) as acc:
        assert npu_ops.resolve("grouped_matmul", acc).source == "torch_npu.npu_grouped_matmul"
        assert npu_ops._GMM_DW_KERNEL[0] is dw_kernel
        y = npu_ops.grouped_matmul(x, w, counts)
        cot = torch.randn(y.shape, generator=g)
        dx, dw = torch.autograd.grad((y.float() * cot).sum(), (x, w))
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    dxr, dwr = torch.autograd.grad((reference.grouped_matmul(xr, wr, counts) * cot.double()).sum(), (xr, wr))
    torch.testing.assert_close(dw.double(), dwr, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(dx.double(), dxr, rtol=5e-2, atol=5e-2)
    assert bool((dw[1] == 0).all())  # the expert without tokens


def test_rms_norm_with_a_float32_weight_runs_the_kernel_in_float32():
    """The docstring requires gamma's dtype = x's: bf16 x with a float32 weight runs in float32, the
    reference's output dtype."""
    x, wt = torch.randn(4, 32).bfloat16(), torch.randn(32)
    with npu_sim.activate():
        import torch_npu

        seen = []
        real = torch_npu.npu_rms_norm
        torch_npu.npu_rms_norm = lambda a, b, epsilon=1e-6: seen.append((a.dtype, b.dtype)) or real(a, b, epsilon=epsilon)
        try:
            out = npu_ops.rms_norm(x, wt, 1e-6)
        finally:
            torch_npu.npu_rms_norm = real
    assert seen == [(torch.float32, torch.float32)] and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference.rms_norm(x.double(), wt.double(), 1e-6), rtol=1e-5, atol=1e-5)
