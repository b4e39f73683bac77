"""The op table a run prints at start and --require-device-kernels (slime.config.device_kernels), on the CPU and
under the torch_npu simulator (tests/npu_sim: a simulation of the documented contracts, not hardware)."""

from __future__ import annotations

import argparse
import json

import pytest

from slime.accelerator import op_report
from slime.config.device_kernels import check_device_kernels
from slime.config.preflight_report import PreflightError


def _args(model_type: str, require: bool) -> argparse.Namespace:
    return argparse.Namespace(hf_config={"model_type": model_type}, require_device_kernels=require)


def test_cpu_table_names_every_op_of_the_family_as_reference():
    from slime.accelerator import get_accelerator, set_accelerator

    previous = get_accelerator()
    set_accelerator("cpu")
    try:
        acc = get_accelerator()
        lines = check_device_kernels(_args("glm5_next", False), acc)
        assert lines[0].startswith("ops on cpu for model family glm5_next")
        ops = [line.split("->")[0].strip() for line in lines[1:]]
        assert ops == list(op_report.MODEL_OPS["glm5_next"])
        assert "kda" in ops and "apply_rotary" not in ops  # NoPE MLA: no rotary
        assert "by design" in next(line for line in lines if "token_log_probs" in line)
        assert "FALLBACK: cpu has no device kernels" in next(line for line in lines if " kda " in line)
        with pytest.raises(PreflightError, match=r"^--require-device-kernels: on cpu, model family glm5_next would "
                                                 r"run rms_norm, attention, sparse_attention, kpool_indexer, kda"):
            check_device_kernels(_args("glm5_next", True), acc)
    finally:
        set_accelerator(previous)


def test_unknown_family_reports_every_op():
    assert op_report.model_ops("no_such_family") == op_report.OP_NAMES
    assert op_report.model_ops(None) == op_report.OP_NAMES


def test_glm5_on_the_simulated_npu_runs_on_kernels_and_passes_the_check():
    npu_sim = pytest.importorskip("npu_sim")
    with npu_sim.activate(reuse_probes=True) as acc:
        lines = check_device_kernels(_args("glm_moe_dsa", True), acc)  # no refusal: every op on a kernel
        table = dict(line.split(" -> ", 1) for line in lines[1:])
        sources = {k.strip(): v for k, v in table.items()}
        assert sources["swiglu"] == "torch_npu.npu_swiglu"
        assert sources["sparse_attention"] == "torch_npu.npu_fusion_attention"
        assert not any("FALLBACK" in v for v in sources.values())


@pytest.fixture(scope="module")
def glm5_model(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("dk") / "model"))


def test_a_removed_kernel_makes_train_exit_2_naming_the_op(tmp_path, glm5_model, capsys, monkeypatch):
    """train.py's main on the simulated NPU with npu_swiglu gone from torch_npu: exit 2 before Ray, the one error
    line names swiglu; without the flag the run would start, its table saying FALLBACK."""
    npu_sim = pytest.importorskip("npu_sim")
    from slime.accelerator import get_accelerator, set_accelerator
    from slime.train import main

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    argv = ["--hf-checkpoint", glm5_model, "--prompt-data", str(data), "--rm-type", "synthetic",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--output-dir", str(tmp_path / "out"), "--require-device-kernels"]
    previous = get_accelerator()
    with npu_sim.activate() as acc:
        monkeypatch.delattr(npu_sim.fake_torch_npu, "npu_swiglu")
        set_accelerator(acc)
        try:
            rc = main(argv)
        finally:
            set_accelerator(previous)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py: error")]
    assert rc == 2
    assert len(err) == 1 and "would run swiglu on the pure-torch reference" in err[0]
    assert not (tmp_path / "out").exists()
