"""KDA ops (slime/accelerator/ops/kda.py): the chunked delta rule with a per-channel decay, the causal convolutions
and the forget gate against transformers' glm5_next functions and a float64 token-by-token recurrence; packed
sequences equal each sequence alone, no state crosses a boundary; the CUDA glue's argument plumbing (fla-core /
causal-conv1d replaced by stand-ins with their signatures, no GPU here).

Tolerances: float64 vs the float64 recurrence 1e-10 (outputs and grads); float32 vs transformers' float32 functions
2e-5 (O(1) values, 130 tokens); the test recurrence vs transformers' recurrent function 2e-5 (float32); the
gate vs transformers' (float32 inside) 1e-6."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as hf

from slime.accelerator.ops import cuda_kda, reference_op
from slime.accelerator.ops.kda import causal_conv1d, kda, kda_gate

F64 = torch.float64


def recurrence(q, k, v, g, beta, scale=None):
    """The KDA recurrence token by token, one sequence [T, H, *], in the inputs' dtype."""
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * (scale or q.shape[-1] ** -0.5)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    state = q.new_zeros(k.shape[1], k.shape[2], v.shape[2])
    out = []
    for t in range(k.shape[0]):
        state = state * g[t].exp()[..., None]
        update = beta[t][:, None] * (v[t] - (state * k[t][..., None]).sum(-2))
        state = state + k[t][..., None] * update[:, None, :]
        out.append((state * q[t][..., None]).sum(-2))
    return torch.stack(out) if out else v.new_zeros(v.shape)


def inputs(length, heads=2, dk=16, dv=8, dtype=F64, decay="bounded", seed=0):
    """Random KDA inputs; decay "bounded": the model's gate with lower bound -5, "steep": log-decays down to -40
    per token (no bound: products of per-channel factors that would overflow unpivoted), "none": g = 0."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, heads, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(length, heads, dv, generator=gen, dtype=dtype)
    raw = torch.randn(length, heads, dk, generator=gen, dtype=dtype)
    g = {"bounded": -5.0 * torch.sigmoid(raw), "steep": -40.0 * torch.rand(length, heads, dk, generator=gen, dtype=dtype),
         "none": torch.zeros_like(raw)}[decay]
    beta = torch.rand(length, heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_the_test_recurrence_is_transformers_recurrent_kda():
    q, k, v, g, beta = inputs(70, dtype=torch.float32)
    ours = recurrence(q, k, v, g, beta)
    theirs, _ = hf.recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], None, False,
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("length, decay", [(1, "bounded"), (2, "steep"), (17, "none"), (63, "steep"), (64, "bounded"),
                                           (65, "steep"), (130, "bounded"), (130, "none")])
def test_kda_float64_equals_the_recurrence(length, decay):
    q, k, v, g, beta = inputs(length, decay=decay, seed=length)
    out = kda(q, k, v, g, beta, cu(length))
    assert out.dtype == F64 and out.shape == v.shape
    torch.testing.assert_close(out, recurrence(q, k, v, g, beta), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("length", [1, 63, 65, 130])
def test_kda_float32_equals_transformers_chunk_and_recurrent(length):
    q, k, v, g, beta = inputs(length, heads=3, dk=32, dv=16, dtype=torch.float32, seed=7)
    out = kda(q, k, v, g, beta, cu(length))
    batch = [t[None] for t in (q, k, v, g, beta)]
    chunked, _ = hf.chunk_kimi_delta_attention(*batch, use_qk_l2norm_in_kernel=True)
    recurrent, _ = hf.recurrent_kimi_delta_attention(*batch, None, False, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, chunked[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out, recurrent[0], atol=2e-5, rtol=0)


def test_kda_scale_and_bfloat16_output_dtype():
    q, k, v, g, beta = inputs(40, dtype=torch.float32, seed=2)
    torch.testing.assert_close(kda(q, k, v, g, beta, cu(40), scale=0.3),
                               recurrence(q, k, v, g, beta, scale=0.3), atol=2e-5, rtol=0)
    out = kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), cu(40))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("decay", ["bounded", "steep"])
def test_packed_sequences_equal_each_alone_and_grads_equal_the_recurrence(accel, decay):
    lengths = (65, 1, 0, 130, 63)
    tensors = [t.requires_grad_() for t in inputs(sum(lengths), decay=decay, seed=11)]
    out = accel.ops.kda(*tensors, cu(*lengths))
    weights = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    expected, start = [], 0
    for n in lengths:
        piece = [t.detach()[start:start + n].requires_grad_() for t in tensors]
        alone = recurrence(*piece)
        expected.append(alone)
        if n:
            ref_grads = torch.autograd.grad((alone * weights[start:start + n]).sum(), piece)
            for ours, ref in zip(grads, ref_grads):
                torch.testing.assert_close(ours[start:start + n], ref, atol=1e-10, rtol=1e-10)
        start += n
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-10, rtol=1e-10)


def test_no_state_crosses_a_sequence_boundary():
    """Two sequences that share a chunk slot position: the second one's outputs do not depend on the first's
    tokens (values and gradients), even with no decay at all (g = 0 keeps every state contribution)."""
    lengths = (70, 50)
    q, k, v, g, beta = inputs(sum(lengths), decay="none", seed=4)
    v = v.clone().requires_grad_()
    out = kda(q, k, v, g, beta, cu(*lengths))
    (grad,) = torch.autograd.grad(out[70:].sum(), v)
    assert grad[:70].abs().max() == 0
    v2 = v.detach().clone()
    v2[:70] = torch.randn(70, *v.shape[1:], dtype=F64)
    torch.testing.assert_close(kda(q, k, v2, g, beta, cu(*lengths))[70:], out[70:].detach(), atol=0, rtol=0)


def forget_gate(lower_bound, heads=3, dim=8, hidden=12):
    torch.manual_seed(0)
    config = hf.Glm5NextTextConfig(hidden_size=hidden, linear_num_heads=heads, linear_head_dim=dim,
                                   linear_lower_bound=lower_bound)
    gate = hf.Glm5NextTextForgetGate(config).double()
    with torch.no_grad():
        gate.A_log.copy_(torch.randn(heads))
        gate.dt_bias.copy_(torch.randn(heads * dim) * 3)
        gate.f_b_proj.weight.mul_(30)  # pre-activations past softplus's threshold of 20 too
    return gate


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_equals_transformers_forget_gate(accel, lower_bound):
    gate = forget_gate(lower_bound)
    x = torch.randn(2, 9, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    f = gate.f_b_proj(gate.f_a_proj(x))
    assert (f.abs() > 20).any()
    theirs = gate(x).reshape(18, 3, 8)  # float32: transformers casts to float32 whatever the input
    ours = accel.ops.kda_gate(f.reshape(18, 3, 8), gate.A_log, gate.dt_bias, lower_bound)
    assert ours.dtype == F64
    torch.testing.assert_close(ours, theirs.double(), atol=1e-6 * theirs.abs().max().item(), rtol=0)
    f32 = kda_gate(f.float().reshape(18, 3, 8), gate.A_log.float(), gate.dt_bias.float(), lower_bound)
    assert f32.dtype == torch.float32 and bool((f32 <= 0).all())
    torch.testing.assert_close(f32, theirs, atol=1e-6 * theirs.abs().max().item(), rtol=0)
    if lower_bound is not None:
        assert bool((f32 >= lower_bound).all())


@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_equals_transformers_per_sequence(accel, activation):
    lengths = (5, 0, 1, 3, 12)
    x = torch.randn(sum(lengths), 6, dtype=F64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=F64, requires_grad=True)
    out = accel.ops.causal_conv1d(x, weight, cu(*lengths), activation)
    grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), (x, weight))
    pieces, start = [], 0
    for n in lengths:
        if n:  # F.conv1d refuses an empty sequence
            pieces.append(hf.causal_conv1d_fn(x[start:start + n].T[None], weight, activation=activation)[0].T)
        start += n
    expected = torch.cat(pieces)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    ref_grads = torch.autograd.grad((expected * torch.arange(out.numel()).view_as(out)).sum(), (x, weight))
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-12)


def test_causal_conv1d_float32_weights_with_bfloat16_tokens():
    x, weight = torch.randn(9, 4).bfloat16(), torch.randn(4, 3)
    out = causal_conv1d(x, weight, cu(4, 5))
    expected = torch.cat([hf.causal_conv1d_fn(x[:4].T[None], weight, activation="silu")[0].T,
                          hf.causal_conv1d_fn(x[4:].T[None], weight, activation="silu")[0].T])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_bad_inputs_name_the_problem():
    q, k, v, g, beta = inputs(8)
    with pytest.raises(ValueError, match="q, k and g"):
        kda(q, k[..., :8], v, g, beta, cu(8))
    with pytest.raises(ValueError, match="beta"):
        kda(q, k, v, g, beta[:, :1], cu(8))
    with pytest.raises(TypeError, match="int32"):
        kda(q, k, v, g, beta, cu(8).long())
    with pytest.raises(ValueError, match="ends at"):
        kda(q, k, v, g, beta, cu(7))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(q[:, 0], torch.randn(16, 4, dtype=F64), cu(8), "gelu")
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g, torch.zeros(3), torch.zeros(32), -5.0)


def test_op_table_references_and_cuda_fallback_reasons(monkeypatch):
    from slime.accelerator import ops as ops_mod

    assert reference_op("kda") is kda and reference_op("causal_conv1d") is causal_conv1d
    assert reference_op("kda_gate") is kda_gate
    monkeypatch.setattr(cuda_kda, "_KERNELS", {"chunk_kda": None, "fla_conv": None, "dao_conv": None})
    assert "fla-core" in cuda_kda.resolve("kda").unavailable and cuda_kda.resolve("kda").fn is None
    assert cuda_kda.resolve("causal_conv1d").fn is None and cuda_kda.resolve("kda_gate") is None
    assert "kda" in ops_mod.OP_NAMES and "kda_gate" in ops_mod.OP_NAMES


def test_cuda_glue_passes_fla_and_causal_conv1d_their_layouts():
    """Stand-ins with fla's chunk_kda / causal_conv1d and causal-conv1d's causal_conv1d_fn signatures, computing
    with the reference, so a wrong layout, flag or sequence split shows up as a mismatch."""
    calls = {}

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        assert q.dim() == 4 and q.shape[0] == 1 and cu_seqlens.dtype == torch.long and use_qk_l2norm_in_kernel
        calls["kda"] = True
        return kda(q[0], k[0], v[0], g[0], beta[0], cu_seqlens.int(), scale)[None], None

    def fla_conv(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                 activation=None, backend=None, cu_seqlens=None):
        assert x.dim() == 3 and x.shape[0] == 1 and weight.dim() == 2
        return causal_conv1d(x[0], weight, cu_seqlens.int(), activation)[None], None

    def dao_conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                 final_states_out=None, activation=None):
        assert x.shape[1] == weight.shape[0] and x.stride(1) == 1  # channel-last, as seq_idx needs
        ids = seq_idx[0].tolist()
        lengths = [ids.count(i) for i in range(max(ids) + 1)]
        return causal_conv1d(x[0].T, weight, cu(*lengths), activation).T[None]

    q, k, v, g, beta = inputs(90, dtype=torch.float32)
    torch.testing.assert_close(cuda_kda.fla_chunk_kda(chunk_kda, q, k, v, g, beta, cu(20, 70), 0.2),
                               kda(q, k, v, g, beta, cu(20, 70), 0.2), atol=0, rtol=0)
    assert calls["kda"]
    x, weight = torch.randn(11, 5), torch.randn(5, 4)
    expected = causal_conv1d(x, weight, cu(4, 7), "silu")
    for fla, dao in ((fla_conv, None), (None, dao_conv)):
        torch.testing.assert_close(cuda_kda.conv_with_kernels(fla, dao, x, weight, cu(4, 7), "silu"), expected)
