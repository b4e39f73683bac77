"""Activation recompute of the GLM-5 model (MLA + DSA + MoE + MTP; float32, sequences longer than index_topk so
DSA drops keys; hidden dropout on, so every recomputed forward draws random numbers): for full recompute
(uniform and block) and selective recompute (core_attn, layernorm, mlp, moe), every recomputed module's
output in backward equals its first forward bit for bit (megatron's checkpoint restores the RNG states through
the accelerator), and the grads equal those of the run without recompute (rtol 1e-5, atol 1e-6 of the
tensor's largest grad: only the backward's accumulation order may differ)."""

from __future__ import annotations

import pytest
import torch

from glm5_helpers import add_mtp_layer, random_batch, write_checkpoint

RECOMPUTE = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp", "moe"]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return add_mtp_layer(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "glm5", "glm_moe_dsa", seed=4), seed=4)


def _step(ckpt, **overrides):
    """Forward (main + MTP logits) and backward with dropout; returns (grads, outputs per recorded module call)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from slime.accelerator import get_accelerator
    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.common.layers import RMSNorm
    from slime_plugins.models.glm5.attention import CoreAttention

    model = load_hf_model(ckpt, load_mtp=True, hidden_dropout=0.1, **overrides).train()
    calls: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (TransformerLayer, CoreAttention, RMSNorm)) or type(m).__name__ in ("MoELayer", "SwiGLUMLP"):
            m.register_forward_hook(lambda mod, args, out, name=name: calls.setdefault(name, []).append(
                (out[0] if isinstance(out, tuple) else out).detach().clone()))
    ids, pos = random_batch(2, 12, 512, 9)  # 12 tokens > index_topk = 8
    weight = torch.randn(2, 12, 512, generator=torch.Generator().manual_seed(9))
    get_accelerator().manual_seed(123)
    logits, mtp = model(ids, pos, mtp_logits=True)
    ((logits * weight).sum() + (mtp[0] * weight).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, calls


@pytest.fixture(scope="module")
def baseline(ckpt):
    return _step(ckpt)


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recomputed_forward_is_bitwise_the_first(ckpt, baseline, name):
    base_grads, base_calls = baseline
    grads, calls = _step(ckpt, **RECOMPUTE[name])
    recomputed = {k: v for k, v in calls.items() if len(v) == 2}
    expect_layers = 4 if name == "full_uniform" else None  # 3 decoder layers + the MTP layer, each recomputed
    layers = [k for k in recomputed if k.endswith(("layers.0", "layers.1", "layers.2", "transformer_layer"))]
    if expect_layers:
        assert len(layers) == expect_layers, sorted(recomputed)
    if name == "full_block":
        assert {"decoder.layers.0", "decoder.layers.1"} <= set(recomputed) and "decoder.layers.2" not in recomputed
    if name == "selective":
        kinds = {k.rsplit(".", 1)[-1] for k in recomputed}
        assert {"core_attention", "input_layernorm", "pre_mlp_layernorm", "mlp"} <= kinds, sorted(recomputed)
    assert recomputed, "nothing was recomputed"
    for key, (first, again) in recomputed.items():
        assert torch.equal(first, again), f"{name}: recomputed {key} differs from its first forward"
        torch.testing.assert_close(first, base_calls[key][0], rtol=0, atol=0, msg=f"{name}: {key} vs no recompute")
    assert grads.keys() == base_grads.keys()
    for n, g in grads.items():
        scale = float(base_grads[n].abs().max())
        torch.testing.assert_close(g, base_grads[n], rtol=1e-5, atol=1e-6 * scale, msg=f"{name}: grad {n}")
