"""Block-FP8 quantization through the op table (fp8_block_quantize: reference slime/accelerator/ops/fp8.py, Ascend
mapping slime/accelerator/ascend/fp8_ops.py on torch_npu.npu_dynamic_block_quant) under the torch_npu simulator,
held against the recorded wheel facts (tests/data/npu_fp8_facts.json). Simulation, not hardware."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from slime.accelerator.ascend import fp8_ops
from slime.accelerator.ops import fp8 as fp8_reference
from slime.utils import fp8_blocks

npu_sim = pytest.importorskip("npu_sim")
FACTS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "npu_fp8_facts.json"), encoding="utf-8"))
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _weight(shape, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * torch.logspace(-4, 1, shape[-1])  # blocks of very different ranges
    return w.to(dtype)


def _dequantized(q, s, shape):
    return q.double() * fp8_reference.expand_blocks(s.double(), *shape[-2:], (128, 128))


@pytest.mark.parametrize("soc", ["950PR", "950DT"])
@pytest.mark.parametrize("shape", [(300, 260), (3, 130, 257), (128, 128), (1, 700)])
def test_kernel_equals_the_reference_on_the_950(soc, shape):
    with npu_sim.activate(soc=soc, reuse_probes=True) as acc:
        assert acc.ops.source("fp8_block_quantize") == "torch_npu.npu_dynamic_block_quant"
        w = _weight(shape, seed=sum(shape))
        if len(shape) == 2 and shape[0] >= 256:
            w[128:256, :128] = 0  # an all-zero block: scale 1 in the checkpoint's format
        calls = fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0)
        q, s = acc.ops.fp8_block_quantize(w, (128, 128))
        assert fp8_ops.KERNEL_CALLS[fp8_ops.KERNEL] == calls + 1
    q_ref, s_ref = fp8_reference.fp8_block_quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)  # amax / 448 per block, 1 for the zero block
    # e4m3 codes: equal but for a rounding tie between the two divisions (at most one e4m3 step, 1/8 relative)
    deq, ref = _dequantized(q, s, shape), _dequantized(q_ref, s_ref, shape)
    assert float(((deq - ref).abs() - 0.125 * ref.abs()).max()) <= 1e-12
    assert float((q.float() != q_ref.float()).float().mean()) < 1e-3
    assert float((deq - w.double()).abs().max()) <= float(s_ref.max()) * 16 + 1e-12  # half an e4m3 step at 448


def test_other_inputs_take_the_reference_on_the_950(monkeypatch):
    with npu_sim.activate(soc="950PR", reuse_probes=True) as acc:
        assert acc.ops.source("fp8_block_quantize") == "torch_npu.npu_dynamic_block_quant"  # built (and probed)
        for w, block in [(_weight((200, 300), 1, torch.float32), (128, 128)),  # float32: not cast to bf16
                         (_weight((200, 300), 2), (100, 128)),  # a block size the kernel does not take
                         (_weight((2, 2, 130, 140), 3), (128, 128))]:  # 4-D
            calls = fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0)
            q, s = acc.ops.fp8_block_quantize(w, block)
            assert fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0) == calls
            q_ref, s_ref = fp8_reference.fp8_block_quantize(w, block)
            assert torch.equal(q.float(), q_ref.float()) and torch.equal(s, s_ref)
        monkeypatch.setattr(fp8_ops, "_DEVICE_TYPE", ["npu"])  # on hardware a host tensor takes the reference too
        calls = fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0)
        acc.ops.fp8_block_quantize(_weight((200, 300), 4), (128, 128))
        assert fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0) == calls


@pytest.mark.parametrize("soc", ["A2", "A3"])
def test_a2_a3_quantize_on_the_reference_and_say_so(soc):
    from slime.accelerator import op_report

    with npu_sim.activate(soc=soc, reuse_probes=True) as acc:
        assert acc.ops.source("fp8_block_quantize") == "reference"
        rows = op_report.op_rows(acc.ops, op_report.model_ops("glm5", fp8_checkpoint=True))
    assert op_report.fallbacks(rows) == ["fp8_block_quantize"]  # every other glm5 op has a kernel on A2/A3
    assert any("fp8_block_quantize" in line and f"writes int8 only on {soc}" in line for line in _logged())
    refusal = op_report.refusal("npu", "glm5", rows)
    assert refusal is not None and "fp8_block_quantize" in refusal and "\n" not in refusal


def _logged() -> list[str]:
    from slime.accelerator import ops as ops_mod

    return list(ops_mod._LOGGED)


def test_the_report_lists_the_op_only_for_fp8_checkpoints():
    from slime.config.device_kernels import fp8_checkpoint

    assert fp8_checkpoint({"model_type": "glm5_next", "quantization_config": FP8_CONFIG})
    assert fp8_checkpoint({"model_type": "x", "text_config": {"quantization_config": FP8_CONFIG}})
    assert not fp8_checkpoint({"model_type": "glm5_next"}) and not fp8_checkpoint(None)
    from slime.accelerator import op_report

    assert "fp8_block_quantize" not in op_report.model_ops("glm5_next")
    assert op_report.model_ops("glm5_next", fp8_checkpoint=True)[-1] == "fp8_block_quantize"


def test_release_gate_and_a_wrong_kernel_keep_the_reference(monkeypatch):
    with npu_sim.activate(soc="950PR", release="7.1.0") as acc:
        assert acc.ops.source("fp8_block_quantize") == "reference"
    assert any("predates torch_npu.npu_dynamic_block_quant" in line for line in _logged())
    with npu_sim.activate(soc="950PR") as acc:
        right = npu_sim.fake_torch_npu.npu_dynamic_block_quant

        def inverted_scale(x, **kw):  # finite but wrong: returns the quantization multiplier, not its inverse
            y, s = right(x, **kw)
            return y, 1.0 / s
        monkeypatch.setattr(npu_sim.fake_torch_npu, "npu_dynamic_block_quant", inverted_scale)
        assert acc.ops.source("fp8_block_quantize") == "reference"
    assert any("probe of torch_npu.npu_dynamic_block_quant on 950PR failed: block scales" in line for line in _logged())


def test_contract_violations_raise_in_the_simulator():
    with npu_sim.activate(soc="A3"):
        with pytest.raises(RuntimeError, match="int8"):
            npu_sim.fake_torch_npu.npu_dynamic_block_quant(_weight((4, 256), 0), dst_type=torch.float8_e4m3fn)
    with npu_sim.activate(soc="950DT"):
        kernel = npu_sim.fake_torch_npu.npu_dynamic_block_quant
        with pytest.raises(RuntimeError, match="block"):
            kernel(_weight((4, 256), 0), dst_type=torch.float8_e4m3fn, row_block_size=100)
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            kernel(_weight((4, 256), 0, torch.float32), dst_type=torch.float8_e4m3fn)
        with pytest.raises(RuntimeError, match="dst_type_max|unexpected keyword|unknown"):
            kernel(_weight((4, 256), 0), dst_type=torch.float8_e4m3fn, block=(128, 128))


def test_weight_sync_quantizes_on_the_device_table():
    """quantize_named (the FP8 engine's weights) goes through the op table: the kernel on a simulated 950."""
    from slime.accelerator import get_accelerator, set_accelerator

    named = [("layers.0.mlp.experts.0.down_proj.weight", _weight((200, 300), 5)), ("norm.weight", torch.ones(8))]
    expected = list(fp8_blocks.quantize_named(named, {named[0][0]}))  # CPU: the reference
    previous = get_accelerator()
    with npu_sim.activate(soc="950PR", reuse_probes=True) as acc:
        set_accelerator(acc)
        try:
            assert acc.ops.source("fp8_block_quantize") == "torch_npu.npu_dynamic_block_quant"  # built (and probed)
            calls = fp8_ops.KERNEL_CALLS.get(fp8_ops.KERNEL, 0)
            sent = list(fp8_blocks.quantize_named(named, {named[0][0]}))
            assert fp8_ops.KERNEL_CALLS[fp8_ops.KERNEL] == calls + 1
        finally:
            set_accelerator(previous)
    assert [n for n, _ in sent] == [n for n, _ in expected]
    assert torch.equal(sent[1][1], expected[1][1])  # the scales
    deq, ref = _dequantized(sent[0][1], sent[1][1], (200, 300)), _dequantized(expected[0][1], expected[1][1], (200, 300))
    assert float(((deq - ref).abs() - 0.125 * ref.abs()).max()) <= 1e-12
    assert sent[2][1] is named[1][1]


def test_wheel_facts_and_the_simulator_agree():
    wheels = FACTS["torch_npu"]
    assert len(wheels) >= 31 and all(w["schema"] for w in wheels.values())  # in every wheel 2.7.1 .. 2.14.0
    newest = wheels["2.14.0"]["schema"]
    inner = newest[newest.index("(") + 1: newest.index(") ->")]
    names = [a.split("=")[0].split()[-1] for a in inner.split(",") if a.strip() not in ("", "*")]
    simulated = npu_sim.fake_torch_npu._quant.npu_dynamic_block_quant
    params = inspect.signature(simulated).parameters
    assert list(params) == names and all(p.kind == p.KEYWORD_ONLY for p in list(params.values())[1:])
    for w in wheels.values():  # the torch_npu page: A2/A3, int8 only; the 950's FP8 comes from CANN's operator
        assert w["doc_products"] == ["Atlas A2训练系列产品", "Atlas A3训练系列产品"] and "int8" in w["doc_dst_type"]
    assert "float8_e4m3fn" in FACTS["ops_nn"]["950"]["dst_types"] and FACTS["ops_nn"]["a2_a3"]["dst_types"] == ["int8"]
    assert set(fp8_ops.ROW_BLOCKS) == set(FACTS["ops_nn"]["950"]["row_block_size"])
    assert set(fp8_ops.COL_BLOCKS) == set(FACTS["ops_nn"]["950"]["col_block_size"])
    pinned = wheels["2.12.0"]["schema"]
    for keyword in ("dst_type", "row_block_size", "col_block_size"):  # what slime passes exists in the pinned wheel
        assert f"int {keyword}=" in pinned
