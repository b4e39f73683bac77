"""The model registry (every family served, no megatron import, one-line errors), config translation of published
GQA and DeepSeek-V3-family shapes, Kimi-K2 as deepseek_v3, DeepSeek-V3's MTP layer, tied embeddings and bad
checkpoints. What every family must meet (logits and grads vs transformers, HF round trip, packed sequences,
engine log-probs, the parallel layouts) is tests/test_model_conformance.py, parametrised from the registry."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from glm5_helpers import hf_model, random_batch
from safetensors.torch import load_file

from slime.backends.megatron import HFCheckpointError, export_hf, load_hf_model

VOCAB = 512


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("families")
    # initializer_range 0.2: attention far from uniform, routers far from ties.
    return {t: write_tiny_checkpoint(str(root / t), t, seed=3, initializer_range=0.2) for t in ("qwen3", "deepseek_v3")}


def _rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def test_registry_serves_every_family_and_imports_no_megatron():
    code = ("import sys; from slime_plugins.models.registry import families, supported_model_types; "
            "print(' '.join(supported_model_types())); print(' '.join(f.name for f in families())); "
            "assert 'megatron' not in sys.modules and 'megatron.core' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    types, names = out[0].split(), out[1].split()
    assert types == sorted(types) and names == sorted(names)
    # these stay served (a family joining adds to them: tests/test_model_conformance.py then covers it)
    assert set(types) >= {"llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "glm4", "glm4_moe_lite", "glm_moe_dsa",
                          "deepseek_v3", "kimi_k2", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                          "qwen3_5_moe_text", "mimo", "minimax_m2"}
    assert set(names) >= {"deepseek_v3", "glm4", "glm4_moe", "glm5", "llama", "mimo", "minimax_m2", "qwen2", "qwen3",
                          "qwen3_5", "qwen3_moe", "qwen3_next"}


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
    """Kimi-K2 ships model_type kimi_k2 (no transformers type): the same model as deepseek_v3 (identical logits;
    its engine log-probs and round trip are the conformance suite's kimi_k2 case)."""
    import shutil

    from slime_plugins.models.registry import UnsupportedModelError, parse_hf_config

    kimi = tmp_path / "kimi"
    shutil.copytree(ckpts["deepseek_v3"], kimi)
    cfg = json.load(open(kimi / "config.json"))
    json.dump(cfg | {"model_type": "kimi_k2"}, open(kimi / "config.json", "w"))
    ids, pos = random_batch(2, 9, VOCAB, 5)
    with torch.no_grad():
        model = load_hf_model(str(kimi))
        torch.testing.assert_close(model(ids, pos), load_hf_model(ckpts["deepseek_v3"])(ids, pos), rtol=0, atol=0)
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


def test_tied_embeddings_are_one_tensor(ckpts):
    """qwen3's tiny checkpoint ties lm_head to the embedding (as Qwen3-4B): no output weight of its own,
    no lm_head.weight in the checkpoint or the export."""
    model = load_hf_model(ckpts["qwen3"])
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    assert "lm_head.weight" not in load_file(os.path.join(ckpts["qwen3"], "model.safetensors"))
    assert not any(n.startswith("output_layer") for n, _ in model.named_parameters())


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
