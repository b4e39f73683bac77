"""GLM-5.3-Flash's DSA attention (NoPE MLA + k-pool indexer, slime_plugins/models/glm5_next/attention.py) against
transformers' Glm5NextTextAttention on copied weights (eager attention): outputs, the input's grad and every
trained parameter's grad, on sequences longer than index_topk (keys really dropped), packed sequences (each as
if alone), a "shared" layer reusing the full layer before it, and the skip of the indexer where it would keep
every key. The weights are copied through `dsa_weight_maps` (the checkpoint's names).

Tolerances: float64 1e-10 (transformers computes its RMSNorm and eager softmax in float32 even for float64
models; the float64 tests run them in float64, the same maths); float32 (transformers unchanged) outputs
atol 2e-5 + rtol 1e-4, grads 1e-4 of each tensor's max |grad|. With index_kpool_always_select_tail=False the
first kpool - 1 queries of a sequence select nothing: ours gives 0 there, transformers' eager softmax over a
fully masked row has no defined value, so those rows are left out of the comparison (zero weight in the loss).
TP2 x CP2 (spawned ranks, tests/glm5_next_attention_worker.py) equals the single rank in float64 (1e-12).
"""

from __future__ import annotations

import pytest
import torch

from glm5_next_attention_worker import FULL, SHARED, configs, hf_attention, ours_from

from slime_plugins.models.common.rope import ForwardContext

modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

F64, F32 = torch.float64, torch.float32


@pytest.fixture(autouse=True)
def _single_rank():
    from slime.backends.megatron.parallel import init_parallel

    init_parallel(tp=1)


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' RMSNorm and eager attention with their float32 casts left out (float64 models stay float64)."""
    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
        return torch.matmul(torch.softmax(scores, dim=-1), value).transpose(1, 2).contiguous(), None

    monkeypatch.setattr(modeling.Glm5NextTextRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling, "eager_attention_forward", eager)


def context(lengths, rows: int) -> ForwardContext:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_len = sum(lengths) // rows
    return ForwardContext(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens=cu, batch=rows,
                          seq_len=seq_len)


def run_ours(modules, x_thd, ctx, weight):
    """Our layers in order on [T, H] (megatron's [S, B, H] with the rows of ctx): outputs and grads."""
    x = x_thd.detach().view(ctx.batch, ctx.seq_len, -1).transpose(0, 1).contiguous().requires_grad_(True)
    outs = [m(x, packed_seq_params=ctx)[0].transpose(0, 1).reshape(x_thd.shape) for m in modules]
    loss = sum((o * w).sum() for o, w in zip(outs, weight))
    grads = torch.autograd.grad(loss, [x] + [p for m in modules for p in m.parameters() if p.requires_grad])
    x_grad = grads[0].transpose(0, 1).reshape(x_thd.shape)
    return [o.detach() for o in outs], x_grad, list(grads[1:])


def run_theirs(modules, x_thd, lengths, weight):
    """transformers' layers on each sequence alone (the top-k handed from a full layer to the next, as its model
    does): outputs and grads summed over the sequences."""
    x = x_thd.detach().requires_grad_(True)
    outs, start = [[] for _ in modules], 0
    for n in lengths:
        topk = None
        for i, m in enumerate(modules):
            out, _, topk = m(x[None, start:start + n], torch.ones(1, n, dtype=torch.bool), prev_topk_indices=topk)
            outs[i].append(out[0])
        start += n
    outs = [torch.cat(o) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weight))
    grads = torch.autograd.grad(loss, [x] + [p for m in modules for p in m.parameters() if p.requires_grad])
    return [o.detach() for o in outs], grads[0], list(grads[1:])


def trained(hf_modules):
    return [p for m in hf_modules for n, p in m.named_parameters() if "indexer" not in n]


def compare(lengths, dtype, rows: int = 1, with_shared: bool = False, seed: int = 0, **overrides):
    hf_config, arch = configs(**overrides)
    layers = [FULL, SHARED] if with_shared else [FULL]
    theirs = [hf_attention(hf_config, layer, dtype, seed + layer) for layer in layers]
    ours = [ours_from(t, arch, layer, dtype) for t, layer in zip(theirs, layers)]
    for t in theirs:  # transformers' indexer runs under no_grad: its weights get no grad, as ours are frozen
        if t.indexer is not None:
            t.indexer.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 100)
    total = sum(lengths)
    x = torch.randn(total, arch.hidden_size, generator=g, dtype=F64).to(dtype)
    weight = [torch.randn(total, arch.hidden_size, generator=g, dtype=F64).to(dtype) for _ in layers]
    if not arch.index_kpool_always_select_tail:  # rows without a selected key: not defined in transformers
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        for w in weight:
            for start, n in zip(offsets, lengths):
                w[start:start + min(n, arch.index_kpool - 1)] = 0
    got, got_x, got_p = run_ours(ours, x, context(lengths, rows), weight)
    from slime.accelerator.transformers_patches import StableTopk  # slime's tie rule in transformers' indexer

    with StableTopk():
        want, want_x, want_p = run_theirs(theirs, x, lengths, weight)
    assert len(got_p) == len(want_p) == len(trained(theirs))
    for o, ref, w in zip(got, want, weight):
        keep = (w != 0).any(-1)
        assert_close(o[keep], ref[keep], dtype)
    assert_close(got_x, want_x, dtype, grad=True)
    for a, b, p in zip(got_p, want_p, trained(theirs)):
        assert a.shape == p.shape
        assert_close(a, b, dtype, grad=True)
    return ours, arch


def assert_close(a, b, dtype, grad: bool = False):
    if dtype == F64:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    elif grad:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("lengths", [[21], [13, 5, 18]])
def test_equals_transformers_float64(float64_transformers, lengths):
    compare(lengths, F64, seed=len(lengths))


@pytest.mark.parametrize("lengths", [[21], [13, 5, 18]])
def test_equals_transformers_float32(lengths):
    compare(lengths, F32, seed=len(lengths))


def test_shared_layer_reuses_the_full_layers_selection(float64_transformers, monkeypatch):
    """Layer 2 ("shared") attends over layer 1's selection: equal to transformers, and the indexer runs once."""
    from slime_plugins.models.glm5_next import attention

    calls = []
    forward = attention.KpoolIndexer.forward
    monkeypatch.setattr(attention.KpoolIndexer, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    ours, _ = compare([19, 14], F64, with_shared=True, seed=3)
    assert ours[1].indexer is None and ours[1].topk_source == FULL
    assert len(calls) == 1


def test_without_the_tail_and_with_a_batch_of_rows(float64_transformers):
    """always_select_tail off (the tail keys dropped, the first kpool - 1 queries see nothing) on a [2, 17] batch."""
    compare([17, 17], F64, rows=2, seed=5, index_kpool_always_select_tail=False)


def test_keys_are_dropped_and_the_skip_is_exact(float64_transformers, monkeypatch):
    """Above index_topk + kpool - 1 tokens the selection changes the output (keys really dropped); at or below it
    the layer skips the indexer, and forcing the masked path gives the same values."""
    from slime_plugins.models.glm5_next import attention

    hf_config, arch = configs()
    module = ours_from(hf_attention(hf_config, FULL, F64, 7), arch, FULL, F64)
    x = torch.randn(21, 1, arch.hidden_size, dtype=F64)
    sparse = module(x, packed_seq_params=context([21], 1))[0]
    monkeypatch.setattr(attention.NopeMlaDsaAttention, "may_drop_keys", lambda self, ctx: False)
    dense = module(x, packed_seq_params=context([21], 1))[0]
    assert (sparse[11:] - dense[11:]).abs().max() > 1e-3  # from position 11 on (3 complete pools), one is left out
    torch.testing.assert_close(sparse[:11], dense[:11], rtol=0, atol=1e-12)
    monkeypatch.undo()
    short = x[:11]  # 11 = index_topk + kpool - 1: every key kept
    assert not module.may_drop_keys(context([11], 1))
    skipped = module(short, packed_seq_params=context([11], 1))[0]
    monkeypatch.setattr(attention.NopeMlaDsaAttention, "may_drop_keys", lambda self, ctx: True)
    torch.testing.assert_close(module(short, packed_seq_params=context([11], 1))[0], skipped, rtol=0, atol=1e-12)


def test_weight_maps_use_the_checkpoints_names(tmp_path):
    """dsa_weight_maps names exactly the attention tensors transformers saves (Glm5NextForConditionalGeneration,
    the published checkpoint's class) for a full and a shared layer."""
    from safetensors import safe_open
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from slime_plugins.models.glm5_next.attention import dsa_weight_maps
    from slime_plugins.models.glm5_next.tiny import TINY_VISION

    hf_config, arch = configs()
    vision = TINY_VISION | dict(out_hidden_size=arch.hidden_size)
    Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=hf_config.to_dict(), vision_config=vision)
                                     ).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    for layer in (FULL, SHARED):
        prefix = f"model.language_model.layers.{layer}.self_attn"
        maps = dsa_weight_maps(arch, layer, f"decoder.layers.{layer}.self_attention", prefix)
        assert {n for m in maps for n in m.hf} == {n for n in saved if n.startswith(prefix + ".")}
    assert f"model.language_model.layers.{FULL}.self_attn.indexer.index_kpool_compress_gate" in saved


def test_a_shared_layer_without_a_full_layer_before_it_is_refused():
    from slime_plugins.models.glm5_next.attention import topk_source_layer

    _, arch = configs()
    assert topk_source_layer(arch, SHARED) == FULL and topk_source_layer(arch, FULL) == FULL
    broken = type("Arch", (), {"indexer_type": lambda self, i: [None, "shared", "shared", None][i]})()
    with pytest.raises(ValueError, match="no full DSA layer precedes it"):
        topk_source_layer(broken, 2)


@pytest.mark.parametrize("tp, cp", [(2, 2)])
def test_parallel_layouts_equal_the_single_rank(tmp_path, tp, cp):
    """A full and a shared layer at TP2 x CP2 (heads split, sequence parallel; load-balanced chunks, latent keys
    and indexer inputs gathered over CP): outputs, input grads and parameter grads (summed over CP ranks, TP shards
    joined by their weight-map kind) equal the single rank's in float64 (1e-12)."""
    import glm5_next_attention_worker as worker
    from glm5_helpers import spawn_ranks

    from slime_plugins.models.glm5_next.attention import dsa_weight_maps

    want = worker.rank_step(1, 1)
    spawn_ranks(worker.run, tp * cp, tp, cp, str(tmp_path))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp * cp)]
    for key in ("outs", "x_grad"):
        wanted = want[key] if key == "outs" else [want[key]]
        for i, ref in enumerate(wanted):
            got = torch.full_like(ref, float("nan"))
            for part in parts:
                got[part["rows"]] = part[key][i] if key == "outs" else part[key]
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12, msg=f"{key} {i}")
    _, arch = configs()
    kinds = {f"{i}.{m.param[2:]}": m for i, layer in enumerate((FULL, SHARED))
             for m in dsa_weight_maps(arch, layer, "a", "h")}
    assert want["grads"].keys() == parts[0]["grads"].keys() and len(want["grads"]) == 14
    for name, ref in want["grads"].items():
        shards = [sum(p["grads"][name] for p in parts if p["tp_rank"] == t) for t in range(tp)]
        torch.testing.assert_close(kinds[name].to_hf(shards)[0], ref, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("accel", ["npu-sim"], indirect=True)
def test_the_ascend_glue_serves_the_nope_layer(accel, monkeypatch):
    """Under the torch_npu contract simulator the NoPE layer's sparse attention (Dqk 8, Dv 6, no rope part) runs
    on npu_fusion_attention per sequence with the selection mask (the absorbed-MLA kernel needs 512 + 64), and
    the layer still equals transformers (float32 tolerances)."""
    import importlib

    assert accel.ops.source("sparse_attention") == "torch_npu.npu_fusion_attention"
    npu = importlib.import_module("torch_npu")
    calls = []
    kernel = npu.npu_fusion_attention
    monkeypatch.setattr(npu, "npu_fusion_attention", lambda *a, **k: calls.append(k.get("atten_mask")) or kernel(*a, **k))
    compare([21, 13], F32, seed=9)
    assert len(calls) >= 2 and all(mask is not None for mask in calls)


def test_in_the_family_model_the_dsa_layers_equal_transformers(monkeypatch, tmp_path):
    """The glm5_next model (tiny checkpoint saved by transformers: layer 2 "full", layer 3 "shared") with these
    DSA layers and, in its KDA layers, transformers' own module (the family's KDA is tested on its own): logits
    within 1e-5 of max |logit| and every grad outside the KDA layers within 1e-4 of its tensor's max |grad|
    (float32), on a [2, 21] batch (keys dropped). transformers runs with slime's patch set (the indexer's tie rule)."""
    import json
    import os

    from glm5_next_helpers import grads_by_hf_name, hf_grads_on_disk, hf_reference, load_state, save_checkpoints
    from safetensors.torch import load_file

    from slime.accelerator import get_accelerator
    from slime.accelerator.patches import is_applied
    from slime.backends.megatron.parallel import init_parallel
    from slime_plugins.models.common.weights import REPLICATED, WeightMap
    from slime_plugins.models.glm5_next import layer as layer_module
    from slime_plugins.models.glm5_next import weights as weights_module
    from slime_plugins.models.glm5_next.config import LINEAR, from_hf
    from slime_plugins.models.glm5_next.model import build_model

    reference = hf_reference()
    ckpt = save_checkpoints(reference, tmp_path)["glm5_next_text"]
    kda_names, kda_tensors = {}, {}
    for i, layer in enumerate(reference.model.language_model.layers):
        if reference.config.text_config.layer_types[i] == LINEAR:
            state = layer.self_attn.state_dict()
            kda_names[i] = list(state)
            kda_tensors.update({f"mixer.{i}.{n}": t.detach().clone() for n, t in state.items()})
    family_maps = weights_module.mixer_maps

    def maps(arch, layer, prefix, hf_prefix):
        if arch.is_linear(layer):
            return [WeightMap(f"{prefix}.self_attention.hf.{n}", (f"mixer.{layer}.{n}",), REPLICATED)
                    for n in kda_names[layer]]
        return family_maps(arch, layer, prefix, hf_prefix)

    monkeypatch.setitem(layer_module.MIXERS, LINEAR, ("glm5_next_helpers", "TransformersMixer"))
    monkeypatch.setattr(weights_module, "mixer_maps", maps)
    with open(os.path.join(ckpt, "config.json")) as f:
        arch = from_hf(json.load(f))
    assert [arch.indexer_type(i) for i in range(arch.num_hidden_layers)] == [None, None, "full", "shared", None]
    init_parallel(1, 1, 1, seed=1, cp=None)
    model = build_model(arch)
    load_state(model, load_file(os.path.join(ckpt, "model.safetensors")) | kda_tensors)
    model.train()
    g = torch.Generator().manual_seed(0)
    ids, pos = torch.randint(3, 512, (2, 21), generator=g), torch.arange(21).expand(2, 21).contiguous()
    acc = get_accelerator()
    was_applied = is_applied(acc.name, "transformers")
    acc.apply_patches("transformers")
    try:
        theirs = reference(input_ids=ids).logits
    finally:
        if not was_applied:
            acc.revert_patches("transformers")
    ours = model(ids, pos)
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    w = torch.randn(theirs.shape, generator=g)
    (theirs * w).sum().backward()
    (ours * w).sum().backward()
    ref_grads, ours_grads = hf_grads_on_disk(reference), grads_by_hf_name(model)
    dsa = [n for n in ours_grads if ".self_attn." in n and not n.startswith("mixer.")]
    assert len(dsa) == 14  # 7 trained tensors in each DSA layer, none of the frozen indexer's
    for name, grad in ours_grads.items():
        if not name.startswith("mixer."):
            ref = ref_grads[name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]]
            assert float((grad - ref).abs().max()) <= 1e-4 * float(ref.abs().max()) + 1e-7, name


def test_selective_recompute_of_the_core_attention_gives_the_same_grads():
    """recompute_modules=["core_attn"]: the sparse attention is recomputed in backward from q, k, v and the selection
    (float64, equal to 1e-12)."""
    hf_config, arch = configs()
    hf = hf_attention(hf_config, FULL, F64, 4)
    x = torch.randn(19, 1, arch.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(4))
    results = []
    for overrides in ({}, dict(recompute_granularity="selective", recompute_modules=["core_attn"])):
        module = ours_from(hf, arch, FULL, F64, **overrides)
        assert module.recompute_core_attention == bool(overrides)
        leaf = x.clone().requires_grad_(True)
        out = module(leaf, packed_seq_params=context([19], 1))[0]
        (out * out.detach().sin()).sum().backward()  # megatron's checkpoint takes .backward() only
        results.append((out.detach(), [leaf.grad] + [p.grad for p in module.parameters() if p.requires_grad]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-12)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
