"""Op table construction: providers per accelerator, SLIME_OPS, version fallbacks with one log line,
lazy probing, and the rule that op implementations live only in slime/accelerator/."""

from __future__ import annotations

import logging
import os
import re
import sys
import types

import pytest
import torch

from slime.accelerator import CpuAccelerator
from slime.accelerator import ops as ops_mod
from slime.accelerator.ops import OP_NAMES, DeviceOp, build_op_table, parse_ops_env, reference, reference_op

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
npu_sim = pytest.importorskip("npu_sim")


@pytest.fixture(autouse=True)
def fresh_log_dedup(monkeypatch):
    monkeypatch.setattr(ops_mod, "_LOGGED", set())
    monkeypatch.delenv("SLIME_OPS", raising=False)


def test_cpu_table_is_the_reference():
    table = build_op_table(CpuAccelerator())
    assert set(table.sources().values()) == {"reference"}
    for name in OP_NAMES:
        assert getattr(table, name) is reference_op(name)


def test_table_is_read_only_and_names_unknown_ops():
    table = build_op_table(CpuAccelerator())
    with pytest.raises(AttributeError, match="read-only"):
        table.rms_norm = None
    with pytest.raises(AttributeError, match="rms_norm"):
        table.flash_attention  # noqa: B018


def test_parse_ops_env():
    assert parse_ops_env("") == {} and parse_ops_env("auto") == {}
    assert parse_ops_env("reference") == {n: "reference" for n in OP_NAMES}
    assert parse_ops_env("attention=reference, rms_norm=auto") == {"attention": "reference", "rms_norm": "auto"}
    for bad in ("attention", "atention=reference", "attention=fast"):
        with pytest.raises(ValueError, match="SLIME_OPS"):
            parse_ops_env(bad)


def test_npu_table_uses_torch_npu_kernels_and_slime_ops_switch(monkeypatch):
    with npu_sim.activate() as acc:
        table = acc.ops
        assert table.source("attention") == "torch_npu.npu_fusion_attention"
        assert table.source("token_log_probs") == "reference"  # no fused kernel mapped
        partial = build_op_table(acc, env="attention=reference,rms_norm=reference")
        assert partial.attention is reference.attention and partial.rms_norm is reference.rms_norm
        assert partial.source("swiglu") == "torch_npu.npu_swiglu"
        monkeypatch.setenv("SLIME_OPS", "reference")
        assert set(build_op_table(acc).sources().values()) == {"reference"}


def test_missing_kernel_falls_back_with_one_log_line(caplog):
    caplog.set_level(logging.WARNING, logger="slime.accelerator.ops")
    with npu_sim.activate(release="7.2.0") as acc:  # no lightning indexer yet, no gating backward
        for _ in range(2):
            table = build_op_table(acc)
        assert table.lightning_indexer is reference.lightning_indexer
        assert table.source("moe_permute") == "torch_npu.npu_moe_token_permute"
    lines = [r.getMessage() for r in caplog.records]
    indexer = [m for m in lines if "lightning_indexer" in m]
    assert len(indexer) == 1, lines
    assert "npu_lightning_indexer" in indexer[0] and "7.3.0" in indexer[0] and "CANN 8.5.0" in indexer[0]
    assert len([m for m in lines if "moe_route" in m and "backward" in m]) == 1, lines


def test_older_release_without_permute_kernels():
    with npu_sim.activate(release="7.0.0") as acc:
        table = build_op_table(acc)
        assert table.moe_permute is reference.moe_permute and table.moe_unpermute is reference.moe_unpermute
        assert table.source("moe_route") == "torch_npu.npu_moe_gating_top_k"


def _route_grad(acc, logits, bias, up):
    w, i = acc.ops.moe_route(logits, bias, 3, 4, 2, 2.5, True)
    return torch.autograd.grad((w * up.gather(1, i)).sum(), logits)[0]


@pytest.mark.parametrize("release", ["7.2.0", "26.1.0"])
def test_moe_route_gradient_on_old_and_new_releases(release):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=g, requires_grad=True)
    bias = torch.randn(16, generator=g) * 0.1
    up = torch.randn(6, 16, generator=g)
    w, i = reference.moe_route(logits, bias, 3, 4, 2, 2.5, True)
    want = torch.autograd.grad((w * up.gather(1, i)).sum(), logits)[0]
    with npu_sim.activate(release=release) as acc:
        import torch_npu

        calls = []
        kernel = torch_npu.npu_moe_gating_top_k
        torch_npu.npu_moe_gating_top_k = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        try:
            got = _route_grad(acc, logits, bias, up)
        finally:
            torch_npu.npu_moe_gating_top_k = kernel
    assert calls, "the gating kernel did not run"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_broken_provider_falls_back(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="slime.accelerator.ops")

    def provider(op, acc):
        if op == "swiglu":
            raise RuntimeError("probe exploded")
        if op == "rms_norm":
            return DeviceOp(lambda x, w, eps=1e-6: x, "fake.rms_norm")
        return None

    module = types.ModuleType("slime_test_broken_provider")
    module.resolve = provider
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class WithProvider(CpuAccelerator):
        op_provider = module.__name__

    table = build_op_table(WithProvider())
    assert table.source("rms_norm") == "fake.rms_norm" and table.swiglu is reference.swiglu
    assert any("swiglu" in r.getMessage() and "probe exploded" in r.getMessage() for r in caplog.records)


# Importing slime probes no op provider: tests/test_accelerator.py::test_import_does_not_touch_device_runtimes.


# Calls that implement an op; outside slime/accelerator/ code must use get_accelerator().ops.<name>.
OP_IMPLEMENTATION = re.compile(
    r"scaled_dot_product_attention|flash_attn|_grouped_mm|grouped_gemm|npu_fusion_attention|npu_rms_norm"
    r"|npu_rotary_mul|npu_swiglu|npu_grouped_matmul|npu_moe_|npu_lightning_indexer|npu_sparse_flash_attention"
)


def op_implementation_lines(root: str = REPO) -> list[str]:
    hits = []
    allowed = os.path.join(root, "slime", "accelerator") + os.sep
    for top in ("slime", "slime_plugins"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if not f.endswith(".py") or path.startswith(allowed):
                    continue
                with open(path, encoding="utf-8") as fh:
                    hits += [f"{os.path.relpath(path, root)}:{i}" for i, line in enumerate(fh, 1) if OP_IMPLEMENTATION.search(line)]
    return hits


def test_no_op_implementation_outside_accelerator():
    hits = op_implementation_lines()
    assert not hits, "op implementations outside slime/accelerator/ (call get_accelerator().ops.<op>):\n" + "\n".join(hits)


def test_op_implementation_detector_catches_one(tmp_path):
    (tmp_path / "slime_plugins" / "models").mkdir(parents=True)
    (tmp_path / "slime" / "accelerator").mkdir(parents=True)
    (tmp_path / "slime_plugins" / "models" / "m.py").write_text("import torch.nn.functional as F\ny = F.scaled_dot_product_attention(q, k, v)\n")
    (tmp_path / "slime" / "accelerator" / "ok.py").write_text("F.scaled_dot_product_attention(q, k, v)\n")
    assert op_implementation_lines(str(tmp_path)) == [os.path.join("slime_plugins", "models", "m.py") + ":2"]
