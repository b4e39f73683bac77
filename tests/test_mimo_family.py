"""The mimo family's own behaviour (MiMo-7B: Qwen2 plus MTP layers `model.mtp_layers.{k}`) on megatron-core, on a
tiny random checkpoint (slime_plugins/models/mimo/tiny.py: transformers ships no `mimo` type, so a transformers
Qwen2 plus seeded MTP tensors under the published names):
- the published config reads as a MiMo with MTP;
- the MTP layer (load_mtp) against a float64 reference written from the published MiMoMTPLayers (token / hidden
  norms, input_proj over cat(hidden, token), transformers' Qwen2DecoderLayer, final norm, lm_head): depth-1 logits
  within 1e-5 and the MTP tensors' grads within 1e-5 of each max |grad| (+1e-7); export_hf / save_hf give the
  checkpoint back bit for bit with the MTP layer trained or passed through; no MTP training under pp;
- weight sync sends MTP layers only to a speculative SGLang draft.
The main model against transformers' Qwen2 (logits, grads, HF round trip, engine log-probs) and the dp2 / tp2 / cp2
layouts, with the MTP logits at every tp / ep layout equal to mtp_reference below (1e-5), are
tests/test_model_conformance.py's mimo case."""

from __future__ import annotations

import json
import os

import pytest
import torch
from glm5_helpers import megatron_grads_by_hf_name, random_batch
from safetensors.torch import load_file

from slime.backends.megatron import export_hf, load_hf_model, save_hf

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from slime_plugins.models.mimo.tiny import write_tiny_mimo_checkpoint

    return write_tiny_mimo_checkpoint(str(tmp_path_factory.mktemp("mimo") / "mimo"), seed=3, initializer_range=0.2)


def qwen2_of(path, dtype=torch.float32):
    """transformers' Qwen2ForCausalLM over a MiMo checkpoint's main-model tensors (its MTP tensors unused)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = json.load(open(os.path.join(path, "config.json")))
    config = Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    return Qwen2ForCausalLM.from_pretrained(str(path), config=config, dtype=dtype).eval()


def mtp_reference(path, ids, pos, weight):
    """float64 MiMo MTP depth 1 from the published architecture; returns (logits, {MTP tensor name: grad of
    sum(logits * weight)})."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    model = qwen2_of(path, torch.float64)
    prefix = "model.mtp_layers.0."
    own = {k[len(prefix):]: v.double().requires_grad_() for k, v in load_file(os.path.join(path, "model.safetensors")).items()
           if k.startswith(prefix)}
    layer = Qwen2DecoderLayer(model.config, 0).double().eval()
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(own[name])
    eps = model.config.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    hidden = model.model(ids, position_ids=pos).last_hidden_state.detach()
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # token t + 1 at row t
    embedded = model.model.embed_tokens(shifted).detach()
    x = torch.nn.functional.linear(torch.cat([rms(hidden, own["hidden_layernorm.weight"]),
                                              rms(embedded, own["token_layernorm.weight"])], -1), own["input_proj.weight"])
    seq = ids.shape[1]
    mask = torch.full((seq, seq), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None].expand(ids.shape[0], 1, seq, seq)
    x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
    logits = torch.nn.functional.linear(rms(x, own["final_layernorm.weight"]), model.lm_head.weight.detach())
    (logits * weight.double()).sum().backward()
    return logits.detach(), {prefix + k: (params[k] if k in params else v).grad for k, v in own.items()}


def _rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.detach().double() - ref.detach().double()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def test_config_and_registry():
    from slime_plugins.models.registry import parse_hf_config

    cfg = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "scripts/models/configs/mimo-7B-rl.json")).read())
    family, arch = parse_hf_config(cfg)
    assert family.name == "mimo" and family.supports_mtp and arch.mtp_num_layers == 1 and arch.qkv_bias
    assert (arch.num_hidden_layers, arch.num_key_value_heads, arch.mlp_type(36)) == (36, 8, "dense")


def test_mtp_layer_matches_the_float64_reference_and_round_trips(ckpt, tmp_path):
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    passed = {n: t for b in export_hf(load_hf_model(ckpt)) for n, t in b}  # MTP tensors passed through untrained
    assert passed.keys() == original.keys() and all(torch.equal(passed[n].cpu(), original[n]) for n in original)
    model = load_hf_model(ckpt, load_mtp=True)
    ids, pos = random_batch(2, 11, VOCAB, 9)
    weight = torch.randn(2, 11, VOCAB, generator=torch.Generator().manual_seed(9))
    weight[:, -1] = 0  # the last row has no token t + 1 to embed (both sides pad it alike; not compared)
    logits, (mtp1,) = model(ids, pos, mtp_logits=True)
    ref_logits, ref_grads = mtp_reference(ckpt, ids, pos, weight)
    assert _rel_max(mtp1[:, :-1], ref_logits[:, :-1]) <= 1e-5
    (mtp1 * weight).sum().backward()
    ours = megatron_grads_by_hf_name(model)
    assert set(ref_grads) <= ours.keys()
    for name, g in ref_grads.items():
        err = float((ours[name].double() - g).abs().max())
        assert err <= 1e-5 * float(g.abs().max()) + 1e-7, (name, err, float(g.abs().max()))
    exported = {n: t for b in export_hf(model) for n, t in b}
    assert exported.keys() == original.keys() and all(torch.equal(exported[n].cpu(), original[n]) for n in original)
    save_hf(model, str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "saved" / "config.json"))["model_type"] == "mimo"
    with pytest.raises(ValueError, match="MiMo MTP training under pipeline parallel is not supported"):
        from slime_plugins.models.mimo.model import build_model

        build_model(model.arch, pp=2, mtp=True)


def test_weight_sync_sends_mtp_layers_only_to_a_speculative_sglang_draft():
    """upstream's MiMo script asks SGLang for an EAGLE draft (the MTP layers); the embedded engine has no draft, so
    weight sync leaves the MTP tensors out for it, as without the option."""
    from types import SimpleNamespace

    from slime.backends.megatron.weight_sync import engines_load_mtp

    assert not engines_load_mtp(SimpleNamespace(sglang_speculative_algorithm=None, rollout_engine="sglang"))
    assert not engines_load_mtp(SimpleNamespace(sglang_speculative_algorithm="EAGLE", rollout_engine="embedded"))
