"""Ascend op guards, release selection and the one-time probes, checked against the SIMULATED torch_npu
(tests/npu_sim: documented contracts, not hardware): a SoC's input limits send the call to the reference
(or the next kernel) with one log line; a mapping is used only from its `since` release; a kernel that
fails its probe on the SoC is replaced by the reference with one line naming the op, the SoC and the error."""

from __future__ import annotations

import logging

import pytest
import torch

npu_sim = pytest.importorskip("npu_sim")

from slime.accelerator.ascend import ops as npu_ops  # noqa: E402
from slime.accelerator.ascend import probes  # noqa: E402
from slime.accelerator.ascend.support import release_of, soc_of  # noqa: E402
from slime.accelerator.ops import build_op_table, reference  # noqa: E402

LOGGER = "slime.accelerator.ops"


@pytest.fixture(autouse=True)
def _fresh_log_once(monkeypatch):
    from slime.accelerator import ops

    monkeypatch.setattr(ops, "_LOGGED", set())  # every test sees its own one-time log lines


@pytest.mark.parametrize("version,release", [
    ("2.12.0", "26.1.0"), ("2.12.0+sim", "26.1.0"), ("2.9.0.post2", "26.0.0"), ("2.8.0.post2", "7.3.0"),
    ("2.8.0.post3", "7.3.0"), ("2.8.0", "7.2.0"), ("2.6.0", "7.1.0"), ("2.4.0.post2", "6.0.0"),
    ("2.14.0", "26.1.0"), ("2.1.0.post3", None), ("nightly", None),
])
def test_release_of_places_torch_npu_wheels(version, release):
    assert release_of(version) == release


@pytest.mark.parametrize("name,soc", [("Ascend950PR", "950PR"), ("Ascend950DT", "950DT"), ("Ascend910_9392", "A3"),
                                      ("Ascend910B3", "A2"), ("", "unknown")])
def test_soc_of_device_names(name, soc):
    assert soc_of(name) == soc


@pytest.mark.parametrize("release", ["6.0.0", "7.0.0", "7.1.0", "7.2.0", "7.3.0", "26.1.0"])
def test_mapping_selection_follows_the_installed_release(release):
    """A mapping is in the table exactly from its `since` release: 7.1.0 has the permute kernels but not
    their backward (so no permute mapping), 6.0.0 has another grouped-matmul signature (no mapping)."""
    with npu_sim.activate(release=release) as acc:
        sources = build_op_table(acc).sources()
    key = tuple(int(p) for p in release.split("."))
    for op, mapping in npu_ops.MAPPINGS.items():
        since = tuple(int(p) for p in mapping.since.split("."))
        assert (sources[op] == f"torch_npu.{mapping.kernels[0]}") == (key >= since), (op, release, sources[op])
    if release == "7.1.0":
        assert sources["moe_permute"] == sources["moe_unpermute"] == "reference"
    if release == "6.0.0":
        assert sources["grouped_matmul"] == "reference"


def test_kernel_failing_its_probe_on_the_soc_uses_the_reference_with_one_line(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with npu_sim.activate(soc="950PR") as acc:
        tables = [build_op_table(acc) for _ in range(2)]
        x, w = torch.randn(3, 8), torch.randn(8)
        torch.testing.assert_close(tables[1].rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    assert all(t.source("rms_norm") == "reference" for t in tables)
    assert tables[1].source("lightning_indexer") == "torch_npu.npu_lightning_indexer"  # documented for 950
    lines = [r.getMessage() for r in caplog.records if "ops[npu].rms_norm" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "npu_rms_norm" in lines[0] and "950PR" in lines[0] and "no kernel for Ascend950PR" in lines[0]


def test_probe_runs_once_per_op_and_process(monkeypatch):
    calls = []
    real = probes.probe
    monkeypatch.setattr(probes, "probe", lambda op, *a, **k: calls.append(op) or real(op, *a, **k))
    with npu_sim.activate() as acc:
        for _ in range(3):
            build_op_table(acc)
    # one probe per op and mode: rotary in "half" and "interleave"
    # (plus the sgl-kernel-npu KDA mappings, slime/accelerator/ascend/kda_ops.py)
    assert sorted(calls) == sorted([*npu_ops.MAPPINGS, *npu_ops.kda_ops.MAPPINGS, "sparse_attention_absorbed",
                                    "apply_rotary"])


def test_probe_rejects_non_finite_results_and_kernels_it_did_not_reach(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with npu_sim.activate() as acc:
        import torch_npu

        real = torch_npu.npu_swiglu
        torch_npu.npu_swiglu = lambda x, dim=-1: torch.full_like(x[..., : x.shape[-1] // 2], float("nan"))
        try:
            table = build_op_table(acc)
        finally:
            torch_npu.npu_swiglu = real
        assert table.source("swiglu") == "reference"
        assert "did not reach npu_rms_norm" in probes.probe("rms_norm", reference.rms_norm, acc.device(),
                                                            npu_ops.KERNEL_CALLS, "npu_rms_norm")
    assert any("ops[npu].swiglu" in r.getMessage() and "non-finite" in r.getMessage() for r in caplog.records)


def test_probes_leave_the_rng_streams_alone():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with npu_sim.activate() as acc:
        build_op_table(acc)
    assert torch.equal(torch.rand(4), expected)


def _indexer_inputs(heads, wdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, heads, 128, generator=g).bfloat16()
    k = torch.randn(7, 128, generator=g).bfloat16()
    w = torch.randn(7, heads, generator=g).to(wdtype)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return q, k, w, cu, cu, 2


@pytest.mark.parametrize("heads,kernel", [(16, True), (12, False)])
def test_950_indexer_head_guard(heads, kernel, caplog):
    caplog.set_level(logging.WARNING, logger="slime.accelerator.ops")
    with npu_sim.activate(soc="950PR") as acc:
        table = build_op_table(acc)
        before = npu_ops.KERNEL_CALLS.get("npu_lightning_indexer", 0)
        args = _indexer_inputs(heads, torch.float32)  # float32 weights: the mapping passes them in q's dtype
        got = table.lightning_indexer(*args)
        assert (npu_ops.KERNEL_CALLS.get("npu_lightning_indexer", 0) > before) == kernel
    want = reference.lightning_indexer(*args)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    guard = [r.getMessage() for r in caplog.records if "takes (8, 16, 24, 32, 64) query heads" in r.getMessage()]
    assert len(guard) == (0 if kernel else 1)


def _absorbed(heads):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, heads, 576, generator=g).bfloat16()
    k = torch.randn(6, 1, 576, generator=g).bfloat16()
    idx = torch.tensor([[0, -1], [0, 1], [0, -1], [0, 1], [1, 2], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return q, k, k[..., :512], idx, cu, cu


@pytest.mark.parametrize("soc,heads,sfa", [("A3", 4, True), ("A3", 6, False), ("950PR", 6, True)])
def test_sparse_flash_attention_head_guard_per_soc(soc, heads, sfa, caplog):
    """A2/A3 take power-of-two head counts, the 950 any count up to 128; otherwise the mapping runs
    npu_fusion_attention per sequence (950DT) or the reference (where that kernel is missing too)."""
    caplog.set_level(logging.WARNING, logger="slime.accelerator.ops")
    with npu_sim.activate(soc="950DT" if soc == "950PR" else soc) as acc:
        table = build_op_table(acc)
        before = npu_ops.KERNEL_CALLS.get("npu_sparse_flash_attention", 0)
        args = _absorbed(heads)
        got = table.sparse_attention(*args)
        assert (npu_ops.KERNEL_CALLS.get("npu_sparse_flash_attention", 0) > before) == sfa
    torch.testing.assert_close(got.float(), reference.sparse_attention(*args).float(), rtol=2e-2, atol=2e-2)
    assert any("npu_sparse_flash_attention on" in r.getMessage() for r in caplog.records) == (not sfa)


def test_rms_norm_guard_sends_1d_input_to_the_reference():
    with npu_sim.activate() as acc:
        table = build_op_table(acc)
        before = npu_ops.KERNEL_CALLS.get("npu_rms_norm", 0)
        x, w = torch.randn(8), torch.randn(8)
        torch.testing.assert_close(table.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        assert npu_ops.KERNEL_CALLS.get("npu_rms_norm", 0) == before
        table.rms_norm(x.view(1, 8), w, 1e-6)
        assert npu_ops.KERNEL_CALLS.get("npu_rms_norm", 0) == before + 1
