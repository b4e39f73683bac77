"""The model registry and the GQA families (llama, qwen2, qwen3, qwen3_moe, glm4_moe; glm4 with post-attention and
post-MLP norms, interleaved partial rotary, fused gate_up_proj) and the DeepSeek-V3 family
(deepseek_v3 with q LoRA + YaRN mscale + group-limited routing; Moonlight's shape: no q LoRA, 2 shared experts)
on megatron-core vs transformers, float32, on tiny random checkpoints written by transformers:
- logits: max |ours - transformers| <= 1e-5 * max |transformers| (several seeds and lengths);
- grads of sum(logits * w): per tensor, max |diff| <= 1e-5 * max |grad| + 1e-7 (op order differs:
  grouped experts, packed attention);
- export_hf reproduces the checkpoint bit-exactly, save_hf loads in transformers with identical logits;
- the embedded engine's sampled log-probs equal the trainer's teacher-forced log-probs of the same tokens
  (packed THD forward + ops.token_log_probs), within 5e-5 (KV-cached decode vs a full pass, float32);
- packed sequences equal separate sequences (1e-5).
The GLM-5 family's own numerics are in test_glm5_model.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from glm5_helpers import hf_grads_by_checkpoint_name, hf_model, megatron_grads_by_hf_name, megatron_state_cleanup, random_batch
from safetensors.torch import load_file

from slime.backends.megatron import HFCheckpointError, export_hf, load_hf_model, save_hf

GQA_TYPES = ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "glm4"]
# checkpoint name -> (model_type, tiny-config overrides)
CASES = {t: (t, {}) for t in GQA_TYPES} | {"deepseek_v3": ("deepseek_v3", {}), "moonlight": ("deepseek_v3", "MOONLIGHT")}
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def _clean_megatron_state():
    yield from megatron_state_cleanup()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    from slime_plugins.models.deepseek_v3.tiny import MOONLIGHT

    root = tmp_path_factory.mktemp("families")
    # initializer_range 0.2: attention far from uniform, routers far from ties.
    return {name: write_tiny_checkpoint(str(root / name), model_type, seed=3, initializer_range=0.2,
                                        **(MOONLIGHT if overrides == "MOONLIGHT" else overrides))
            for name, (model_type, overrides) in CASES.items()}


def _rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def test_registry_serves_every_family_and_imports_no_megatron():
    code = ("import sys; from slime_plugins.models.registry import families, supported_model_types; "
            "print(' '.join(supported_model_types())); print(' '.join(f.name for f in families())); "
            "assert 'megatron' not in sys.modules and 'megatron.core' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    hybrid = ["qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"]  # test_qwen3_next_family.py
    own_tests = ["mimo", "minimax_m2"]  # tests/test_mimo_family.py, tests/test_minimax_m2_family.py
    assert out[0].split() == sorted(GQA_TYPES + ["glm4_moe_lite", "glm_moe_dsa", "deepseek_v3", "kimi_k2"] + hybrid
                                    + own_tests)
    assert out[1].split() == ["deepseek_v3", "glm4", "glm4_moe", "glm5", "llama", "mimo", "minimax_m2", "qwen2",
                              "qwen3", "qwen3_5", "qwen3_moe", "qwen3_next"]


def test_unknown_model_type_and_bad_configs_are_one_line_errors():
    from slime_plugins.models.registry import ModelFamily, UnsupportedModelError, get_family, parse_hf_config, register_family

    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' is not supported.*supported: deepseek_v3, glm4, "):
        get_family("gpt2")
    with pytest.raises(UnsupportedModelError, match=r"config.json lacks '\w+' \(needed by the qwen3 model\)"):
        parse_hf_config({"model_type": "qwen3", "hidden_size": 8})
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        parse_hf_config(base | {"hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        parse_hf_config(base | {"model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads=3"):
        parse_hf_config(base | {"num_key_value_heads": 3})
    clash = ModelFamily(name="other", model_types=("qwen3",), parse_config="x:y", build_model="x:y",
                        weight_maps="x:y", hf_names="x:y")
    with pytest.raises(ValueError, match="claimed by both model families 'qwen3' and 'other'"):
        register_family(clash)


def test_config_translation_of_published_shapes():
    """Layer kinds, rotary dims and router settings read from the fields the hub configs use."""
    from slime_plugins.models.registry import parse_hf_config

    common = dict(vocab_size=151552, hidden_size=5120, num_hidden_layers=5, num_attention_heads=96,
                  num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    _, glm = parse_hf_config(common | dict(model_type="glm4_moe", first_k_dense_replace=3, n_routed_experts=160,
                                           n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1536,
                                           partial_rotary_factor=0.5, rope_theta=1e6, use_qk_norm=True,
                                           attention_bias=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1))
    assert glm.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 2 and glm.rotary_dim == 64
    assert glm.qk_norm and glm.qkv_bias and not glm.o_bias and glm.router == "sigmoid" and glm.mtp_num_layers == 1
    _, qwen = parse_hf_config(common | dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                                            moe_intermediate_size=768, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen.mlp_layer_types == ("dense", "sparse", "dense", "dense", "dense") and qwen.n_routed_experts == 128
    assert qwen.router == "softmax" and not qwen.router_dtype_float32 and qwen.rotary_dim == 128


@pytest.mark.parametrize("config", ["deepseek-r1", "kimi-k2-Instruct", "moonlight-16B-A3B"])
def test_deepseek_v3_published_configs_read_as_transformers_does(config):
    """The published configs of upstream's DeepSeek-V3-family scripts: layer kinds, routing, q LoRA, and the YaRN
    softmax scale and rotary table (inv_freq, cos/sin factor) equal to transformers' DeepseekV3 modules'."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    from slime_plugins.models.common.rope import inv_freq_and_scaling
    from slime_plugins.models.registry import parse_hf_config

    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "scripts/models/configs", f"{config}.json")))
    family, arch = parse_hf_config(cfg)
    assert family.name == "deepseek_v3" and arch.router == "sigmoid" and not arch.use_dsa and arch.rope_interleave
    k = cfg["first_k_dense_replace"]
    assert arch.mlp_layer_types == ("dense",) * k + ("sparse",) * (cfg["num_hidden_layers"] - k)
    assert (arch.n_group, arch.topk_group, arch.q_lora_rank) == (cfg["n_group"], cfg["topk_group"], cfg["q_lora_rank"])
    assert arch.mtp_num_layers == (cfg.get("num_nextn_predict_layers") or 0)
    hf = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")})
    assert arch.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, arch.qk_head_dim ** -0.5), rel=1e-12)
    inv_freq, scaling = inv_freq_and_scaling(arch)
    ref = DeepseekV3RotaryEmbedding(hf)
    assert torch.equal(inv_freq, ref.inv_freq.float()) and scaling == pytest.approx(ref.attention_scaling, rel=1e-12)
    if config == "deepseek-r1":  # YaRN x40: softmax scale x (0.1 ln 40 + 1)^2
        assert arch.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_kimi_k2_checkpoint_is_deepseek_v3_and_bad_deepseek_configs_are_one_line(ckpts, tmp_path):
    """Kimi-K2 ships model_type kimi_k2 (no transformers type): the same model as deepseek_v3 (identical logits);
    the embedded engine runs it as DeepseekV3ForCausalLM, its log-probs the trainer's."""
    import shutil

    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime_plugins.models.registry import UnsupportedModelError, parse_hf_config

    kimi = tmp_path / "kimi"
    shutil.copytree(ckpts["deepseek_v3"], kimi)
    cfg = json.load(open(kimi / "config.json"))
    json.dump(cfg | {"model_type": "kimi_k2"}, open(kimi / "config.json", "w"))
    ids, pos = random_batch(2, 9, VOCAB, 5)
    with torch.no_grad():
        model = load_hf_model(str(kimi))
        torch.testing.assert_close(model(ids, pos), load_hf_model(ckpts["deepseek_v3"])(ids, pos), rtol=0, atol=0)
    engine = EmbeddedEngine(EngineConfig(model_path=str(kimi)))
    try:
        assert type(engine.model).__name__ == "DeepseekV3ForCausalLM"
        prompt = ids[0, :4].tolist()
        out = engine.generate(prompt, {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
                              return_logprob=True)
        want = _trainer_logprobs(model, [prompt], [out.output_ids])[0]
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float32), want, rtol=0, atol=5e-5)
    finally:
        engine.shutdown()
    with pytest.raises(UnsupportedModelError, match="moe_layer_freq=2 is not supported"):
        parse_hf_config(cfg | {"moe_layer_freq": 2})
    with pytest.raises(UnsupportedModelError, match="only the sigmoid"):
        parse_hf_config(cfg | {"scoring_func": "softmax"})
    with pytest.raises(UnsupportedModelError, match="n_group=3 must divide n_routed_experts=8"):
        parse_hf_config(cfg | {"n_group": 3})


def _deepseek_mtp_reference(path, ids, pos):
    """DeepSeek-V3's MTP depth 1 from transformers modules: the checkpoint's extra layer as a DeepseekV3DecoderLayer
    (MoE: its index >= first_k_dense_replace) fed eh_proj(cat(enorm(embed(ids shifted by 1)), hnorm(final hidden))),
    then shared_head.norm and lm_head."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    model = hf_model(path).eval()
    n = model.config.num_hidden_layers
    own = {k[len(f"model.layers.{n}."):]: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
           if k.startswith(f"model.layers.{n}.")}
    layer = DeepseekV3DecoderLayer(model.config, n).eval()
    experts = range(model.config.n_routed_experts)
    state = {k: v for k, v in own.items() if ".experts." not in k}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
              "shared_head.head.weight"):
        state.pop(k)
    layer.load_state_dict(state, strict=True)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps))

    with torch.no_grad():
        hidden = model.model(ids, position_ids=pos).last_hidden_state
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        x = torch.nn.functional.linear(torch.cat([rms(model.model.embed_tokens(shifted), own["enorm.weight"]),
                                                  rms(hidden, own["hnorm.weight"])], -1), own["eh_proj.weight"])
        seq = ids.shape[1]
        mask = torch.full((seq, seq), torch.finfo(x.dtype).min).triu(1)[None, None].expand(ids.shape[0], 1, seq, seq)
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        return model.lm_head(rms(x, own["shared_head.norm.weight"]))


def test_deepseek_v3_mtp_layer_matches_transformers_trains_and_round_trips(tmp_path):
    """DeepSeek-V3's MTP layer (model.layers.N: enorm, hnorm, eh_proj, MLA + MoE layer, shared_head) with
    load_mtp: depth-1 logits equal to transformers' modules (1e-5 of max |logit|), grads reach eh_proj and its
    experts, export gives the checkpoint back bit for bit; without load_mtp it passes through unchanged."""
    from glm5_helpers import add_mtp_layer

    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    ckpt = add_mtp_layer(write_tiny_checkpoint(str(tmp_path / "mtp"), "deepseek_v3", seed=3, initializer_range=0.2), seed=3)
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    passed = {n: t for b in export_hf(load_hf_model(ckpt)) for n, t in b}
    assert passed.keys() == original.keys() and all(torch.equal(passed[n].cpu(), original[n]) for n in original)
    model = load_hf_model(ckpt, load_mtp=True)
    ids, pos = random_batch(2, 11, VOCAB, 9)
    logits, (mtp1,) = model(ids, pos, mtp_logits=True)
    assert _rel_max(logits, hf_model(ckpt)(ids, position_ids=pos).logits) <= 1e-5
    assert _rel_max(mtp1, _deepseek_mtp_reference(ckpt, ids, pos)) <= 1e-5
    mtp1[:, :-2].sum().backward()  # rows whose target (t + 2) exists
    layer = model.mtp.layers[0]
    assert layer.eh_proj.weight.grad.abs().sum() > 0 and layer.transformer_layer.mlp.experts.weight1.grad.abs().sum() > 0
    exported = {n: t for b in export_hf(model) for n, t in b}
    assert exported.keys() == original.keys() and all(torch.equal(exported[n].cpu(), original[n]) for n in original)


@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_and_grads_match_transformers(accel, ckpts, model_type):
    model = load_hf_model(ckpts[model_type])
    ref = hf_model(ckpts[model_type])
    for seed, (batch, seq) in enumerate([(2, 5), (1, 17)]):
        ids, pos = random_batch(batch, seq, VOCAB, seed)
        weight = torch.randn(batch, seq, VOCAB, generator=torch.Generator().manual_seed(seed))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        logits = model(ids.to(accel.device()), pos.to(accel.device())).cpu()
        ref_logits = ref(ids, position_ids=pos).logits
        assert _rel_max(logits, ref_logits) <= 1e-5, (model_type, seed)
        (logits * weight).sum().backward()
        (ref_logits * weight).sum().backward()
        ours, theirs = megatron_grads_by_hf_name(model), hf_grads_by_checkpoint_name(ref)
        assert ours.keys() == theirs.keys()
        for name, g in theirs.items():
            err = float((ours[name].cpu() - g).abs().max())
            assert err <= 1e-5 * float(g.abs().max()) + 1e-7, (model_type, name, err, float(g.abs().max()))


@pytest.mark.parametrize("model_type", list(CASES))
def test_export_round_trip_is_bit_exact(ckpts, model_type, tmp_path):
    src = ckpts[model_type]
    original = load_file(os.path.join(src, "model.safetensors"))
    model = load_hf_model(src)
    exported = {n: t for bucket in export_hf(model, bucket_bytes=1 << 14) for n, t in bucket}
    assert exported.keys() == original.keys()
    assert [n for n in original if not torch.equal(exported[n].cpu(), original[n])] == []
    save_hf(model, str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "saved" / "config.json"))["model_type"] == CASES[model_type][0]
    ids, pos = random_batch(1, 7, VOCAB, 4)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "saved")(ids, position_ids=pos).logits,
                                   hf_model(src)(ids, position_ids=pos).logits, rtol=0, atol=0)


def test_tied_embeddings_are_one_tensor(ckpts):
    """qwen3's tiny checkpoint ties lm_head to the embedding (as Qwen3-4B): no output weight of its own,
    no lm_head.weight in the checkpoint or the export."""
    model = load_hf_model(ckpts["qwen3"])
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    assert "lm_head.weight" not in load_file(os.path.join(ckpts["qwen3"], "model.safetensors"))
    assert not any(n.startswith("output_layer") for n, _ in model.named_parameters())


@pytest.mark.parametrize("model_type", ["qwen3", "glm4_moe", "glm4", "deepseek_v3"])
def test_packed_sequences_match_separate_sequences(accel, ckpts, model_type):
    from megatron.core.packed_seq_params import PackedSeqParams

    model = load_hf_model(ckpts[model_type])
    lengths = [7, 1, 4]
    seqs = [random_batch(1, n, VOCAB, 20 + i)[0][0] for i, n in enumerate(lengths)]
    cu = torch.tensor([0, 7, 8, 12], dtype=torch.int32, device=accel.device())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    ids = torch.cat(seqs)[None].to(accel.device())
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(accel.device())
    with torch.no_grad():
        out = model(ids, pos, packed_seq_params=packed)[0].cpu()
        for s, start in zip(seqs, [0, 7, 8]):
            alone = model(s[None].to(accel.device()), torch.arange(len(s))[None].to(accel.device()))[0].cpu()
            torch.testing.assert_close(out[start:start + len(s)], alone, rtol=1e-5, atol=1e-5)


def _trainer_logprobs(model, prompts, responses) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response, all sequences in one packed (THD) forward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime.accelerator import get_accelerator

    seqs = [p + r for p, r in zip(prompts, responses)]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    longest = max(len(s) for s in seqs)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=packed)[0]
    out = []
    for start, p, r in zip(cu.tolist(), prompts, responses):
        rows = logits[start + len(p) - 1: start + len(p) + len(r) - 1]
        out.append(get_accelerator().ops.token_log_probs(rows, torch.tensor(r))[0].float())
    return out


@pytest.mark.parametrize("model_type", list(CASES))
def test_engine_logprobs_match_the_trainer_before_and_after_a_weight_sync(ckpts, model_type):
    """Responses sampled by the embedded engine (temperature 1, KV-cached decode) scored by the Megatron
    model in one packed forward: the same log-probs. Then the trainer's weights move, export_hf's
    tensors update the engine (every exported name lands on the engine's tensor, bit-exactly) and the
    log-probs agree again."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig

    model = load_hf_model(ckpts[model_type])
    engine = EmbeddedEngine(EngineConfig(model_path=ckpts[model_type]))
    prompts = [random_batch(1, n, VOCAB, 30 + n)[0][0].tolist() for n in (3, 6)]
    try:
        for step in range(2):
            outs = [engine.generate(p, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i + 10 * step,
                                        "ignore_eos": True}, return_logprob=True) for i, p in enumerate(prompts)]
            want = _trainer_logprobs(model, prompts, [o.output_ids for o in outs])
            for o, lp in zip(outs, want):
                assert len(o.logprobs) == len(o.output_ids) == 6
                torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float32), lp, rtol=0, atol=5e-5)
            if step == 0:
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std().clamp(min=1e-3))
                named = [(n, t.contiguous()) for bucket in export_hf(model) for n, t in bucket]
                assert engine.update_from_named_tensors(named, weight_version="1") == len(named)
                assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in named)
    finally:
        engine.shutdown()


def test_bad_family_checkpoints_fail_with_one_error(ckpts, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["qwen3"], bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["tie_word_embeddings"] = False  # now lm_head.weight is expected but absent
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(HFCheckpointError, match="missing tensors: lm_head.weight"):
        load_hf_model(str(bad))
    with pytest.raises(ValueError, match="num_key_value_heads=2 % tp=4"):
        from slime_plugins.models.registry import parse_hf_config

        parse_hf_config(cfg)[1].check_parallel(4, 1)
