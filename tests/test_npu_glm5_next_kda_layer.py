"""GLM-5.3-Flash's KDA token mixer (slime_plugins/models/glm5_next/kda.py, the tiny test shape) forward and backward
on the SIMULATED Ascend NPU (tests/npu_sim; not hardware): its causal convolutions and forget gate run on the
(simulated) sgl-kernel-npu kernels, kda on the reference, and the output and every grad equal the same module
on the reference op table (bfloat16 model, both measured against the float64 run of the same weights: the simulated-NPU run's largest
error is at most twice the reference table's plus 1e-2 of the tensor's max |value|; the kernels differ from the
reference by bfloat16 roundings of the convolution weights the kernel takes in x's dtype)."""

from __future__ import annotations

import pytest
import torch
from glm5_next_kda_worker import configs, hf_kda, ours_from

from slime.accelerator.ascend import kda_ops

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
npu_sim = pytest.importorskip("npu_sim")


def _run(module, x, lengths):
    from slime_plugins.models.common.rope import ForwardContext

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ctx = ForwardContext(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens=cu, batch=1,
                         seq_len=sum(lengths))
    xs = x.clone().requires_grad_(True)
    out = module(xs, packed_seq_params=ctx)[0]
    out.float().square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out.detach(), xs.grad, grads


def test_kda_layer_runs_its_ops_on_the_simulated_npu_and_equals_the_reference_table():
    from slime.accelerator import get_accelerator, set_accelerator
    from slime.accelerator.ops import build_op_table
    from slime.backends.megatron.parallel import init_parallel

    init_parallel(tp=1)
    hf_config, arch = configs(linear_lower_bound=-5.0)
    module = ours_from(hf_kda(hf_config, torch.float32, 0), arch, torch.float32).to(torch.bfloat16)
    lengths = [13, 1, 30]
    x = torch.randn(sum(lengths), 1, arch.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    previous = get_accelerator()
    with npu_sim.activate(reuse_probes=True) as acc:
        set_accelerator(acc)
        try:
            assert acc.ops.source("kda") == "reference"
            before = dict(kda_ops.KERNEL_CALLS)
            out, gx, grads = _run(module, x, lengths)
            calls = {op: kda_ops.KERNEL_CALLS.get(op, 0) - before.get(op, 0) for op in ("causal_conv1d", "kda_gate")}
            reference_table = build_op_table(acc, env="reference")
            acc.__dict__["_ops"], table = reference_table, acc.__dict__["_ops"]
            try:
                want, want_gx, want_grads = _run(module, x, lengths)
            finally:
                acc.__dict__["_ops"] = table
        finally:
            set_accelerator(previous)
    assert calls["causal_conv1d"] >= 1 and calls["kda_gate"] == 1, calls

    module64 = ours_from(hf_kda(hf_config, torch.float32, 0), arch, torch.float32).double()
    with torch.no_grad():  # the bfloat16 model's own (rounded) weights, in float64
        params = dict(module.named_parameters())
        for name, p in module64.named_parameters():
            p.copy_(params[name].double())
    with npu_sim.activate(reuse_probes=True) as acc:  # float64 truth: the reference table (float64 skips kernels)
        set_accelerator(acc)
        try:
            acc.__dict__["_ops"] = build_op_table(acc, env="reference")
            exact = _run(module64, x.double(), lengths)
        finally:
            set_accelerator(previous)

    def within(ours, ref, truth):
        truth = truth.double()
        bound = 2 * (ref.double() - truth).abs().max().item() + 1e-2 * truth.abs().max().item()
        assert (ours.double() - truth).abs().max().item() <= bound

    within(out, want, exact[0])
    within(gx, want_gx, exact[1])
    assert sorted(grads) == sorted(want_grads) == sorted(exact[2])
    for name in grads:
        within(grads[name], want_grads[name], exact[2][name])
