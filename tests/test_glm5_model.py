"""The GLM-5 family's own behaviour on megatron-core vs transformers (GlmMoeDsaForCausalLM, Glm4MoeLiteForCausalLM),
float32, on tiny random checkpoints: DSA drops tokens beyond index_topk, fused-expert and sharded checkpoints,
bad checkpoints, bf16 with a float32 router, the model scripts, the MTP layer (logits and MTP logits atol 2e-4 +
rtol 1e-4), activation recompute. Logits and grads vs transformers, packed sequences, the HF round trip and
engine log-probs of both model_types are tests/test_model_conformance.py's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from glm5_helpers import hf_model, random_batch, write_checkpoint
from safetensors.torch import load_file, save_file

from slime.backends.megatron import HFCheckpointError, export_hf, load_hf_model

MODEL_TYPES = ["glm_moe_dsa", "glm4_moe_lite"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    return {t: write_checkpoint(root / t, t, seed=1) for t in MODEL_TYPES}


def test_dsa_drops_tokens_beyond_index_topk(ckpts):
    """The DSA test sequences are long enough that top-k selection changes the output."""
    ref = hf_model(ckpts["glm_moe_dsa"]).eval()
    ids, pos = random_batch(1, 19, 512, 0)
    sparse = ref(ids, position_ids=pos).logits
    for m in ref.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = 64
    dense = ref(ids, position_ids=pos).logits
    assert torch.allclose(sparse[:, :8], dense[:, :8], atol=1e-5)  # first 8 queries see <= 8 keys either way
    assert (sparse[:, 8:] - dense[:, 8:]).abs().max() > 1e-2


def test_fused_expert_and_sharded_checkpoints_load(ckpts, tmp_path):
    """transformers 5.x fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` tensors, split over two
    shard files with an index, load to the same model as the per-expert checkpoint."""
    src = ckpts["glm4_moe_lite"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fused, n_exp = {}, 8
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")]) for e in range(n_exp)]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(n_exp)])
    dst = tmp_path / "fused"
    os.makedirs(dst)
    for fn in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, fn)) as a, open(dst / fn, "w") as b:
            b.write(a.read())
    save_file(tensors, dst / "part-1.safetensors")
    save_file(fused, dst / "part-2.safetensors")
    index = {"weight_map": {n: "part-1.safetensors" for n in tensors} | {n: "part-2.safetensors" for n in fused}}
    json.dump(index, open(dst / "model.safetensors.index.json", "w"))
    a, b = load_hf_model(src), load_hf_model(str(dst))
    ids, pos = random_batch(2, 7, 512, 4)
    torch.testing.assert_close(a(ids, pos), b(ids, pos), rtol=0, atol=0)
    exported = {n: t for bucket in export_hf(b) for n, t in bucket}  # per-expert names on the way out
    original = load_file(os.path.join(src, "model.safetensors"))
    assert exported.keys() == original.keys() and all(torch.equal(exported[n], original[n]) for n in original)


def _broken_copy(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_bad_checkpoints_fail_with_one_error_naming_the_problem(ckpts, tmp_path):
    src = ckpts["glm_moe_dsa"]
    with pytest.raises(HFCheckpointError, match="does not exist"):
        load_hf_model(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    json.dump({"model_type": "glm_moe_dsa"}, open(tmp_path / "empty" / "config.json", "w"))
    with pytest.raises(HFCheckpointError, match="no safetensors weights"):
        load_hf_model(str(tmp_path / "empty"))
    bad = _broken_copy(src, tmp_path / "gpt2", edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(HFCheckpointError, match="model_type 'gpt2' is not supported.*glm4_moe_lite, .*glm_moe_dsa"):
        load_hf_model(bad)

    def rename(t):
        t["model.layers.1.mlp.gate.weightX"] = t.pop("model.layers.1.mlp.gate.weight")
        del t["lm_head.weight"]

    bad = _broken_copy(src, tmp_path / "renamed", edit_tensors=rename)
    with pytest.raises(HFCheckpointError) as err:
        load_hf_model(bad)
    msg = str(err.value)
    assert "missing tensors: lm_head.weight, model.layers.1.mlp.gate.weight" in msg
    assert "unused tensors" in msg and "model.layers.1.mlp.gate.weightX" in msg and "\n" not in msg

    def reshape(t):
        t["model.layers.0.self_attn.kv_b_proj.weight"] = t["model.layers.0.self_attn.kv_b_proj.weight"][:, :8].clone()
        t["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)

    bad = _broken_copy(src, tmp_path / "reshaped", edit_tensors=reshape)
    with pytest.raises(HFCheckpointError, match="shape mismatches: model.layers.0.self_attn.kv_b_proj.weight "
                                                r"\(128, 8\) \(model expects \(128, 16\)\).*experts.3.down_proj"):
        load_hf_model(bad)


def test_bf16_keeps_router_float32_and_optimizer_steps_reduce_loss(ckpts):
    from slime.backends.megatron import build_optimizer

    model = load_hf_model(ckpts["glm4_moe_lite"], dtype=torch.bfloat16)
    moe = model.decoder.layers[1].mlp
    assert model.embedding.weight.dtype == torch.bfloat16
    assert moe.router_weight.dtype == torch.float32 and moe.expert_bias.dtype == torch.float32
    model.to(torch.bfloat16)  # what a trainer may do after loading: the router stays float32
    assert moe.router_weight.dtype == torch.float32
    ddp, opt = build_optimizer(model, lr=3e-3, clip_grad=1.0)
    ids, pos = random_batch(2, 12, 512, 5)
    losses = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(ids, pos).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert moe.router_weight.dtype == torch.float32


@pytest.mark.parametrize("script,config", [("glm5", "glm5-744B-A40B"), ("glm4.7-flash", "glm4.7-30B-A3B"),
                                           ("glm5-tiny", "tiny")])
def test_model_scripts_match_their_configs(script, config, ckpts):
    """scripts/models/*.sh MODEL_ARGS agree with the configs they describe (the tiny one with the writer's)."""
    import shlex
    import subprocess

    from slime.plan.model import load_config
    from slime.plan.model_args import mismatches

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(root)}/scripts/models/{script}.sh; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         check=True, capture_output=True, text=True).stdout
    argv = out.splitlines()
    cfg = json.load(open(os.path.join(ckpts["glm_moe_dsa"], "config.json"))) if config == "tiny" else load_config(config)[1]
    assert len(argv) > 20 and mismatches(argv, cfg) == []


def test_mtp_layer_loads_matches_reference_trains_and_round_trips(tmp_path):
    from glm5_helpers import add_mtp_layer, hf_mtp_reference

    ckpt = add_mtp_layer(write_checkpoint(tmp_path / "mtp", "glm_moe_dsa", seed=3), seed=3)
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    # Without load_mtp the MTP tensors pass through unchanged.
    plain = load_hf_model(ckpt)
    assert getattr(plain, "mtp", None) is None
    passed = {n: t for b in export_hf(plain) for n, t in b}
    assert passed.keys() == original.keys() and all(torch.equal(passed[n].cpu(), original[n]) for n in original)

    model = load_hf_model(ckpt, load_mtp=True)
    ids, pos = random_batch(2, 11, 512, 9)
    logits, (mtp1,) = model(ids, pos, mtp_logits=True)
    torch.testing.assert_close(logits, hf_model(ckpt)(ids, position_ids=pos).logits, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(mtp1, hf_mtp_reference(ckpt, ids, pos), rtol=1e-4, atol=2e-4)
    (mtp1[:, :-2].sum()).backward()  # rows whose target (t + 2) exists
    layer = model.mtp.layers[0]
    assert layer.eh_proj.weight.grad.abs().sum() > 0 and layer.transformer_layer.mlp.experts.weight1.grad.abs().sum() > 0
    exported = {n: t for b in export_hf(model) for n, t in b}
    assert exported.keys() == original.keys() and all(torch.equal(exported[n].cpu(), original[n]) for n in original)


def test_activation_recompute_gives_identical_logits_and_grads(ckpts):
    """megatron's full-layer recompute (the DSA top-k and rope tables travel through the recomputed
    closure) reproduces the plain forward and backward exactly."""
    ids, pos = random_batch(2, 10, 512, 11)
    results = []
    for overrides in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        model = load_hf_model(ckpts["glm_moe_dsa"], **overrides)
        logits = model(ids, pos)
        (logits * logits.detach()).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
