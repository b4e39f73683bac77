"""The hybrid Qwen families' own behaviour (qwen3_next; qwen3_5: Qwen3.5 dense / MoE, text-only and
vision-language) on megatron-core vs transformers 5.24, on tiny random checkpoints whose norm weights, A_log and
dt_bias are perturbed (transformers initialises the zero-centred norms at 0, which would hide a missing `1 +`):
- the chunked gated delta rule vs a float64 token-by-token recurrence: 1e-5 of max |o| (odd lengths, several chunks);
- a vision-language checkpoint trains its text model and keeps its vision tower;
- the published configs of upstream's run scripts read as transformers reads them; bad configs are one-line errors;
- torch_dist holds upstream's layout; MODEL_ARGS switches are checked both ways; the published fused-expert layout.
Logits and grads vs transformers (70 tokens, grads 1e-4), packed sequences, the HF round trip, engine log-probs
and the TP2 / EP2 / CP2 / PP2 layouts of every hybrid model_type are tests/test_model_conformance.py's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from glm5_helpers import hf_model, random_batch
from safetensors.torch import load_file, save_file

from slime.backends.megatron import load_hf_model, save_hf

VOCAB = 512
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "scripts", "models", "configs")


def write_hybrid_checkpoint(path: str, model_type: str, seed: int = 3) -> str:
    """A tiny transformers checkpoint with non-trivial norm weights, decays and time-step biases."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(path, model_type, seed=seed, initializer_range=0.2)
    file = os.path.join(path, "model.safetensors")
    state, g = load_file(file), torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            state[name] = t + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(state, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {t: write_hybrid_checkpoint(str(root / t), t) for t in ("qwen3_next", "qwen3_5_moe")}


def _rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def _recurrent_reference(q, k, v, g, beta):
    """The gated delta rule one token at a time, float64 (transformers' recurrent form)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / q.norm(dim=-1, keepdim=True) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True)
    n, length, heads, dk = k.shape
    state = torch.zeros(n, heads, dk, v.shape[-1], dtype=torch.float64)
    out = torch.zeros(*v.shape, dtype=torch.float64)
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("nhkv,nhk->nhv", state, q[:, t])
    return out


@pytest.mark.parametrize("length", [1, 63, 130])
def test_chunked_delta_rule_matches_the_token_recurrence(length):
    from slime_plugins.models.qwen3_next.delta_rule import gated_delta_rule

    g = torch.Generator().manual_seed(length)
    q, k = torch.randn(2, length, 3, 16, generator=g), torch.randn(2, length, 3, 16, generator=g)
    v = torch.randn(2, length, 3, 8, generator=g)
    decay, beta = -2 * torch.rand(2, length, 3, generator=g), torch.rand(2, length, 3, generator=g)
    want = _recurrent_reference(q, k, v, decay, beta)
    assert _rel_max(gated_delta_rule(q, k, v, decay, beta).double(), want) <= 1e-5


def test_vision_language_checkpoint_trains_its_text_model(ckpts):
    """Qwen3.5 as published (Qwen3_5MoeForConditionalGeneration): the text model under model.language_model. is
    the trained model, the vision tower is kept unchanged (its logits against transformers' text model: the
    conformance suite's qwen3_5_moe case)."""
    path = ckpts["qwen3_5_moe"]
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    assert any(n.startswith("model.visual.") for n in names)
    model = load_hf_model(path)
    assert model.arch.hf_prefix == "model.language_model" and model.arch.n_routed_experts == 4
    assert set(model.passthrough_hf) == {n for n in names if n.startswith("model.visual.")}


@pytest.mark.parametrize("config,family,moe", [("qwen3-next-80B-A3B", "qwen3_next", True),
                                                ("qwen3.5-27B", "qwen3_5", False), ("qwen3.5-35B-A3B", "qwen3_5", True)])
def test_published_configs_read_as_transformers_reads_them(config, family, moe):
    from transformers import AutoConfig

    from slime_plugins.models.registry import parse_hf_config

    cfg = json.load(open(os.path.join(CONFIGS, f"{config}.json")))
    fam, arch = parse_hf_config(cfg)
    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    text = hf.get_text_config()
    assert fam.name == family and arch.layer_types == tuple(text.layer_types) and arch.has_moe == moe
    assert arch.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert arch.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"]) == 64
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads) == (text.linear_num_key_heads, text.linear_num_value_heads)
    assert arch.rope_parameters["rope_theta"] == text.rope_parameters["rope_theta"] == 1e7
    assert arch.hf_prefix == ("model" if family == "qwen3_next" else "model.language_model")
    if moe:
        assert (arch.n_routed_experts, arch.num_experts_per_tok, arch.shared_expert_intermediate_size) == (
            text.num_experts, text.num_experts_per_tok, text.shared_expert_intermediate_size)
        assert arch.router == "softmax" and arch.norm_topk_prob


def test_bad_hybrid_configs_are_one_line_errors(ckpts):
    from slime_plugins.models.registry import UnsupportedModelError, parse_hf_config

    cfg = json.load(open(os.path.join(ckpts["qwen3_next"], "config.json")))
    with pytest.raises(UnsupportedModelError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        parse_hf_config(cfg | {"linear_num_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="layer_types must list"):
        parse_hf_config(cfg | {"layer_types": ["linear_attention"] * 3 + ["sliding"]})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=48 % tp=32"):
        parse_hf_config(cfg | {"num_attention_heads": 32, "num_key_value_heads": 32})[1].check_parallel(32, 1)


def test_torch_dist_holds_upstream_layout_and_converts_back(ckpts, tmp_path):
    """tools/convert_hf_to_torch_dist.py on qwen3_next: upstream's key names (a DeltaNet layer's input norm inside
    self_attention, the DeltaNet under self_attention.linear_attn, the gated shared expert's gate_weight) and its
    linear_qkv layout for output-gated attention (per query group: its queries, then their gates, then k, v, as
    upstream's megatron_to_hf/qwen3_next.py reads it); convert_torch_dist_to_hf gives the checkpoint back bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist, torch_dist_to_hf

    src = ckpts["qwen3_next"]
    hf_to_torch_dist(["--hf-checkpoint", src, "--save", str(tmp_path / "td")])
    dcp_to_torch_save(str(tmp_path / "td" / "release"), str(tmp_path / "td.pt"))
    saved = {k: v for k, v in torch.load(tmp_path / "td.pt", weights_only=False).items() if isinstance(v, torch.Tensor)}
    hf = load_file(os.path.join(src, "model.safetensors"))
    layer0, layer1 = "decoder.layers.0.self_attention.", "decoder.layers.1.self_attention."
    assert torch.equal(saved[layer0 + "input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"])
    assert torch.equal(saved[layer0 + "linear_attn.in_proj_qkvz.weight"], hf["model.layers.0.linear_attn.in_proj_qkvz.weight"])
    assert torch.equal(saved["decoder.layers.1.mlp.shared_experts.gate_weight"], hf["model.layers.1.mlp.shared_expert_gate.weight"])
    d, groups, per = 16, 2, 2  # tiny: head_dim 16, 2 query groups of 2 heads
    qkv = saved[layer1 + "linear_qkv.weight"].view(groups, 2 * per + 2, d, -1)
    q = hf["model.layers.1.self_attn.q_proj.weight"].view(groups, per, 2, d, -1)  # [query; gate] per head
    assert torch.equal(qkv[:, :per], q[:, :, 0]) and torch.equal(qkv[:, per:2 * per], q[:, :, 1])
    assert torch.equal(qkv[:, 2 * per], hf["model.layers.1.self_attn.k_proj.weight"].view(groups, d, -1))
    torch_dist_to_hf(["--input-dir", str(tmp_path / "td" / "release"), "--output-dir", str(tmp_path / "back"),
                      "--origin-hf-dir", src])
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def test_model_args_gate_and_norm_switches_are_checked_both_ways():
    """Upstream's MODEL_ARGS of run-qwen3.5-35B-A3B-sft agree with the published config (text_config read); without
    --apply-layernorm-1p / --moe-shared-expert-gate they disagree, one line each; --attention-output-gate on a
    Qwen3-MoE checkpoint disagrees."""
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv = json.load(open(os.path.join(os.path.dirname(__file__), "data", "upstream_train_commands.json"))
                     )["scripts"]["run-qwen3.5-35B-A3B-sft.sh"]["argv"]
    model_args = argv[argv.index("--disable-bias-linear"):argv.index("--hf-checkpoint")]
    cfg = json.load(open(os.path.join(CONFIGS, "qwen3.5-35B-A3B.json")))
    parser = build_parser()
    assert model_arg_mismatches(parser.parse_args(model_args), cfg) == []
    dropped = [a for a in model_args if a not in ("--apply-layernorm-1p", "--moe-shared-expert-gate")]
    assert model_arg_mismatches(parser.parse_args(dropped), cfg) == [
        "--apply-layernorm-1p absent: config.json says zero-centred RMSNorm weights (1 + w)",
        "--moe-shared-expert-gate absent: config.json says shared_expert_gate"]
    qwen3_moe = json.load(open(os.path.join(CONFIGS, "qwen3-30B-A3B.json")))
    bad = model_arg_mismatches(parser.parse_args(["--num-layers", "48", "--attention-output-gate"]), qwen3_moe)
    assert "--attention-output-gate given: config.json says not gated attention (qwen3_next, qwen3_5)" in bad


def test_published_fused_expert_layout_loads_and_saves_back_in_it(ckpts, tmp_path):
    """Qwen3.5-MoE is published with each layer's experts fused (transformers 5's mlp.experts.gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]): the checkpoint in that layout gives transformers' logits, and save_hf
    writes it back in that layout, bit for bit."""
    import re
    import shutil

    src = str(tmp_path / "fused")
    shutil.copytree(ckpts["qwen3_5_moe"], src)
    state, experts = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            state[name] = t
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(count)])
        state[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(count)])
    save_file(state, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    model = load_hf_model(src)
    ids, pos = random_batch(2, 9, VOCAB, 6)
    with torch.no_grad():
        assert _rel_max(model(ids, pos), hf_model(ckpts["qwen3_5_moe"])(ids, position_ids=pos).logits) <= 1e-5
    save_hf(model, str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == state.keys() and all(torch.equal(saved[n], state[n]) for n in state)
