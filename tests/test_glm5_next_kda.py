"""GLM-5.3-Flash's KDA token mixer (slime_plugins/models/glm5_next/kda.py) against transformers'
Glm5NextTextLinearAttention on copied weights (through kda_weight_maps, the checkpoint's names): outputs, the
input's grad and every parameter's grad, one sequence and packed sequences (transformers runs each alone);
TP2 x CP2 (spawned ranks, tests/glm5_next_kda_worker.py) equals the single rank.

Tolerances: float64 1e-10 (transformers computes its KDA, forget gate and gated norm in float32 even for float64
models; the float64 tests run those three in float64: the same maths); float32 (transformers unchanged) outputs
atol 2e-5 + rtol 1e-4, grads 1e-4 of each tensor's max |grad|; TP2 x CP2 vs the single rank 1e-12 (float64)."""

from __future__ import annotations

import pytest
import torch
from glm5_next_kda_worker import configs, hf_kda, on_disk, ours_from

from slime_plugins.models.common.rope import ForwardContext

modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

F64, F32 = torch.float64, torch.float32


@pytest.fixture(autouse=True)
def _single_rank():
    from slime.backends.megatron.parallel import init_parallel

    init_parallel(tp=1)


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' KDA pieces without their float32 casts (float64 models stay float64): the chunked delta
    rule (its own torch code with the casts taken out), the forget gate and the gated norm."""
    from test_kda_ops import recurrence

    def kda(query, key, value, g, beta, use_qk_l2norm_in_kernel=False, **_):
        assert use_qk_l2norm_in_kernel
        return recurrence(query[0], key[0], value[0], g[0], beta[0])[None], None

    def forget_gate(self, x):
        g = (self.f_b_proj(self.f_a_proj(x)) + self.dt_bias.view(1, 1, -1)).view(*x.shape[:2], -1, self.head_dim)
        rate = self.A_log.view(1, 1, self.num_heads, 1).exp()
        if self.safe_gate_lower_bound is not None:
            return self.safe_gate_lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))

    def gated_norm(self, x, gate=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x * torch.sigmoid(gate)

    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", kda)
    monkeypatch.setattr(modeling.Glm5NextTextForgetGate, "forward", forget_gate)
    monkeypatch.setattr(modeling.Glm5NextTextRMSNormGated, "forward", gated_norm)


def context(lengths) -> ForwardContext:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ForwardContext(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens=cu, batch=1,
                          seq_len=sum(lengths))


def compare(lengths, dtype, seed: int = 0, **overrides):
    hf_config, arch = configs(**overrides)
    theirs = hf_kda(hf_config, dtype, seed)
    ours = ours_from(theirs, arch, dtype)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(sum(lengths), arch.hidden_size, generator=g, dtype=F64).to(dtype)
    weight = torch.randn(x.shape, generator=g, dtype=F64).to(dtype)
    xs = x[:, None].clone().requires_grad_(True)
    got = ours(xs, packed_seq_params=context(lengths))[0][:, 0]
    (got * weight).sum().backward()
    xt = x.clone().requires_grad_(True)
    want = torch.cat([theirs(piece[None])[0] for piece in xt.split(lengths)])
    (want * weight).sum().backward()
    assert_close(got, want, dtype)
    assert_close(xs.grad[:, 0], xt.grad, dtype, grad=True)
    their_grads = on_disk({n: p.grad for n, p in theirs.named_parameters()})
    our_params = dict(ours.named_parameters())
    assert sorted(their_grads) == sorted(our_params)
    for name, grad in their_grads.items():
        assert our_params[name].grad.shape == grad.shape, name
        assert_close(our_params[name].grad.to(grad.dtype), grad, dtype, grad=True)
    return ours


def assert_close(a, b, dtype, grad: bool = False):
    if dtype == F64:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    elif grad:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("lengths", [[70], [13, 1, 66]])
def test_equals_transformers_float64(float64_transformers, lengths):
    compare(lengths, F64, seed=len(lengths))


@pytest.mark.parametrize("lengths, lower_bound", [([70], -5.0), ([13, 1, 66], None)])
def test_equals_transformers_float32(lengths, lower_bound):
    compare(lengths, F32, seed=len(lengths), linear_lower_bound=lower_bound)


def test_float32_tensors_stay_float32_under_a_bfloat16_cast():
    """transformers keeps the convolutions, dt_bias and A_log in float32 (_keep_in_fp32_modules_strict)."""
    hf_config, arch = configs()
    module = ours_from(hf_kda(hf_config, F32, 0), arch, F32).to(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in module.named_parameters()}
    kept = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log"}
    assert {n for n, d in dtypes.items() if d == F32} == kept
    x = torch.randn(9, 1, arch.hidden_size, dtype=torch.bfloat16)
    out = module(x, packed_seq_params=context([9]))[0]
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and torch.isfinite(out).all()


def test_weight_maps_use_the_checkpoints_names(tmp_path):
    """kda_weight_maps names exactly the KDA tensors transformers saves for Glm5NextForConditionalGeneration."""
    from safetensors import safe_open
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from slime_plugins.models.glm5_next.kda import kda_weight_maps
    from slime_plugins.models.glm5_next.tiny import TINY_VISION

    hf_config, arch = configs()
    vision = TINY_VISION | dict(out_hidden_size=arch.hidden_size)
    Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=hf_config.to_dict(), vision_config=vision)
                                     ).save_pretrained(tmp_path)
    prefix = "model.language_model.layers.0.self_attn"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {n: f.get_slice(n).get_dtype() for n in f.keys() if n.startswith(prefix + ".")}
    maps = kda_weight_maps(arch, "decoder.layers.0.self_attention", prefix)
    assert {n for m in maps for n in m.hf} == set(saved)
    assert {n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1]
            for n, d in saved.items() if d == "F32"} >= {"q_conv1d", "dt_bias", "A_log"}


def test_parallel_layouts_equal_the_single_rank(tmp_path):
    """TP2 x CP2 (heads split with sequence parallel; whole sequences gathered over CP): outputs, input grads
    and parameter grads (summed over CP ranks, TP shards joined by their weight-map kind; replicated tensors'
    grads equal on both TP ranks) equal the single rank's in float64 (1e-12)."""
    import glm5_next_kda_worker as worker
    from glm5_helpers import spawn_ranks

    from slime_plugins.models.glm5_next.kda import kda_weight_maps

    tp, cp = 2, 2
    want = worker.rank_step(1, 1)
    spawn_ranks(worker.run, tp * cp, tp, cp, str(tmp_path))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp * cp)]
    for key in ("out", "x_grad"):
        got = torch.full_like(want[key], float("nan"))
        for part in parts:
            got[part["rows"]] = part[key]
        torch.testing.assert_close(got, want[key], rtol=0, atol=1e-12, msg=key)
    _, arch = configs()
    maps = {m.param[2:]: m for m in kda_weight_maps(arch, "a", "h")}
    assert want["grads"].keys() == parts[0]["grads"].keys() == maps.keys()
    for name, ref in want["grads"].items():
        shards = [sum(p["grads"][name] for p in parts if p["tp_rank"] == t) for t in range(tp)]
        if maps[name].kind == "replicated":
            torch.testing.assert_close(shards[0], shards[1], rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(maps[name].to_hf(shards)[0], ref, rtol=0, atol=1e-12, msg=name)
