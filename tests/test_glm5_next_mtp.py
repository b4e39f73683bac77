"""GLM-5.3-Flash's MTP layer (slime_plugins/models/glm5_next/mtp.py) on tiny checkpoints saved by transformers with the
MTP layer added as the published one is stored (tests/glm5_next_helpers.add_mtp_layer: layer N, no hc_*):
- float64, against a reference built from transformers' own modules (the main model, then Glm5NextTextAttention with
  its indexer, Glm5NextTextMoE and Glm5NextTextRMSNorm around a plain residual, as SGLang 0.5.23's draft model runs
  the layer): depth-1 logits within 5e-6 of max |logit| (measured 7.0e-7), the MTP loss (the project's mtp_loss:
  per-sample mean cross entropy of token t + 2, times --mtp-loss-scaling-factor) within 1e-6 relative (measured
  8.1e-8), and every grad of that loss (the MTP layer's and the main model's, into which it flows) within 5e-5 of
  its tensor's max |grad| (measured 1.3e-6 on the MTP layer, 1.2e-5 on the main model's mHC scales). Not float64
  to the last bit: transformers' RMSNorms and router compute in float32 inside a float64 model, and our mHC
  parameters stay float32 (as transformers keeps them);
- full recompute gives the same MTP logits and grads, bit for bit;
- load_mtp keeps the vision tower and gives every tensor back bit for bit (export_hf); an MTP layer with
  tensors the layer does not have (hc_*) is refused in one line; a torch_dist checkpoint with the MTP layer converts
  back to the multimodal checkpoint bit for bit without -a (vision tower from --origin-hf-dir);
- 2 gloo ranks (tests/glm5_next_mtp_worker.py), float32: tp2, ep2, pp2 (the MTP block on the last stage with its
  copy of the embedding) through megatron's schedule, and cp2 (each rank's chunks, the MTP inputs one token ahead
  taken from the whole pack as the trainer takes them) give the single process's main loss and MTP loss (1e-6
  relative; measured <= 1.3e-7, the MTP loss equal), logits and MTP logits (1e-5 of max |logit|) and the grads of
  their sum, every parameter's, the MTP layer's included (per tensor 5e-5 of its max |grad| + 1e-7: partial sums
  in another order; measured at most 0.40 of that bound, tp2), and export_hf(all_stages=True) gives every rank the
  single-process export, bit for bit, in its order.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from glm5_next_helpers import add_mtp_layer, grads_by_hf_name, hf_grads_on_disk, hf_reference, save_checkpoints
from safetensors.torch import load_file, save_file

SMOOTH = dict(swiglu_limit=10.0)  # grads compared away from the clamp's edges (tests/test_glm5_next_family.py SMOOTH)
SHAPE = (2, 13)  # 13 > index_topk + kpool - 1 = 11: the main DSA layers and the MTP layer's indexer drop keys
SCALE = 0.3  # --mtp-loss-scaling-factor


@pytest.fixture(scope="module")
def reference():
    return hf_reference(**SMOOTH)


@pytest.fixture(scope="module")
def ckpts(reference, tmp_path_factory):
    out = save_checkpoints(reference, tmp_path_factory.mktemp("glm5_next_mtp"))
    for path in out.values():
        add_mtp_layer(path)
    return out


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, SHAPE, generator=g)
    return ids, torch.arange(SHAPE[1]).expand(SHAPE)


class TransformersMtp(torch.nn.Module):
    """The MTP layer of `ckpt` from transformers' modules (float64), under the checkpoint's names."""

    def __init__(self, reference, ckpt: str) -> None:
        super().__init__()
        from transformers.models.glm5_next import modeling_glm5_next as hf

        config = copy.deepcopy(reference.config.text_config)
        n, h = config.num_hidden_layers, config.hidden_size
        config.layer_types = list(config.layer_types) + ["indexed_attention"]  # the MTP layer: a full DSA layer
        config.indexer_types = list(config.indexer_types) + ["full"]
        config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # torch's grouped_mm has no float64
        prefix = f"model.language_model.layers.{n}."
        own = {k[len(prefix):]: v.double() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()
               if k.startswith(prefix)}
        self.experts = config.n_routed_experts
        for name in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head_norm"):
            setattr(self, name, hf.Glm5NextTextRMSNorm(h, config.rms_norm_eps))
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.self_attn = hf.Glm5NextTextAttention(config, n)
        self.mlp = hf.Glm5NextTextMoE(config)
        self.double()
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                  own.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                       for e in range(self.experts)])
        own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{e}.down_proj.weight")
                                                    for e in range(self.experts)])
        own["shared_head_norm.weight"] = own.pop("shared_head.norm.weight")
        self.load_state_dict(own, strict=True)

    def forward(self, main, ids):
        text = main.model.language_model
        hidden = text(input_ids=ids).last_hidden_state  # h_0: after the streams' collapse and the final norm
        ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # token t + 1 at row t (0 past the end)
        x = self.eh_proj(torch.cat([self.enorm(text.embed_tokens(ahead)), self.hnorm(hidden)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), attention_mask=torch.ones(ids.shape, dtype=torch.bool))[0]
        x = x + self.mlp(self.post_attention_layernorm(x))
        return main.lm_head(self.shared_head_norm(x))

    def grads(self, n: int) -> dict[str, torch.Tensor | None]:
        """Grads under the checkpoint's names (experts split per expert; the expert bias, a buffer: None)."""
        prefix, out = f"model.language_model.layers.{n}.", {}
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith("mlp.experts."):
                for e in range(self.experts):
                    g = None if p.grad is None else p.grad[e]
                    if name.endswith("gate_up_proj"):
                        half = None if g is None else g.chunk(2)
                        out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = None if g is None else half[0]
                        out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = None if g is None else half[1]
                    else:
                        out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = g
                continue
            out[prefix + name.replace("shared_head_norm", "shared_head.norm")] = p.grad
        return out


def _mtp_loss_reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-sample mean cross entropy of token t + 2 over the rows that have one, summed, times SCALE / samples."""
    lp = torch.log_softmax(logits[:, :-2], dim=-1).gather(-1, ids[:, 2:, None])[..., 0]
    return -lp.mean(dim=1).sum() * SCALE / ids.shape[0]


def _mtp_loss_ours(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    from slime.accelerator import get_accelerator
    from slime.backends.megatron.loss import mtp_loss

    batch, seq = ids.shape
    lp, _ = get_accelerator().ops.token_log_probs(logits.reshape(batch * seq, -1),
                                                  torch.cat([ids[:, 2:], torch.zeros_like(ids[:, :2])], 1).reshape(-1))
    mask = torch.ones(batch, seq, dtype=torch.float64)
    mask[:, -2:] = 0  # rows t >= S - 2 have no token t + 2
    loss, _ = mtp_loss([lp], [mask.reshape(-1)], [seq] * batch, normalizer=float(batch), scale=SCALE, per_token=False)
    return loss


def test_mtp_layer_loss_and_grads_equal_the_float64_transformers_reference(reference, ckpts):
    from slime.accelerator.transformers_patches import StableTopk
    from slime.backends.megatron import load_hf_model

    ckpt = ckpts["glm5_next"]
    main = copy.deepcopy(reference).double()
    main.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    theirs = TransformersMtp(reference, ckpt)
    model = load_hf_model(ckpt, dtype=torch.float64, load_mtp=True)
    ids, pos = _batch(7)
    with StableTopk():  # slime's top-k tie rule in transformers' indexers
        ref_logits = theirs(main, ids)
    logits, (ours,) = model(ids, pos, mtp_logits=True)
    assert float((ours - ref_logits).abs().max() / ref_logits.abs().max()) <= 5e-6
    ref_loss, loss = _mtp_loss_reference(ref_logits, ids), _mtp_loss_ours(ours, ids)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)) and float(ref_loss) > 1.0
    ref_loss.backward()
    loss.backward()
    want = hf_grads_on_disk(main) | theirs.grads(main.config.text_config.num_hidden_layers)
    mtp_names, aliases = model.family.call("mtp_names", model.arch)
    assert set(mtp_names) == {n for n in want if ".layers.5." in n} and aliases == {}  # every MTP tensor mapped
    got = grads_by_hf_name(model)
    for name, ref in want.items():
        grad = got.get(name)
        if ref is None or grad is None:  # the indexers run without grad (transformers' and ours, frozen); the expert bias
            assert (".indexer." in name or "e_score" in name) and (grad is None or not grad.any()) and (ref is None or not ref.any()), name
            continue
        assert float((grad - ref).abs().max()) <= 5e-5 * float(ref.abs().max()) + 1e-12, name
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    assert logits.shape == ours.shape


@pytest.mark.parametrize("model_type", ["glm5_next", "glm5_next_text"])
def test_mtp_load_keeps_the_vision_tower_and_exports_bit_exact(ckpts, model_type):
    from slime.backends.megatron import export_hf, load_hf_model

    original = load_file(os.path.join(ckpts[model_type], "model.safetensors"))
    model = load_hf_model(ckpts[model_type], load_mtp=True)
    assert set(model.passthrough_hf) == {n for n in original if n.startswith("model.visual.")}
    assert (model_type == "glm5_next") == bool(model.passthrough_hf)
    exported = {n: t for bucket in export_hf(model, bucket_bytes=1 << 14) for n, t in bucket}
    assert exported.keys() == original.keys()
    assert [n for n in original if not torch.equal(exported[n].cpu(), original[n])] == []


def test_an_mtp_layer_with_foreign_tensors_is_refused(ckpts, tmp_path):
    """hc_* under the MTP layer: the published layer has none, and the MTP block would drop them silently."""
    import shutil

    from slime.backends.megatron import load_hf_model
    from slime.backends.megatron.hf_io import HFCheckpointError

    path = str(tmp_path / "bad")
    shutil.copytree(ckpts["glm5_next_text"], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.5.hc_attn_fn"] = tensors["model.layers.2.hc_attn_fn"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"unused tensors .*model\.layers\.5\.hc_attn_fn"):
        load_hf_model(path, load_mtp=True)
    assert json.load(open(os.path.join(path, "config.json")))["num_nextn_predict_layers"] == 1


@pytest.mark.timeout(600)
def test_mtp_and_main_losses_and_grads_at_tp2_ep2_pp2_cp2_equal_the_single_process(ckpts, tmp_path):
    from glm5_helpers import spawn_ranks
    from glm5_next_mtp_worker import forward_backward_single, run

    from slime.backends.megatron import export_hf, load_hf_model

    ckpt = ckpts["glm5_next"]
    ids, pos = _batch(3)
    ids = ids[:, :12]  # 12 % tp == 0 (sequence parallel), % (2 * cp) == 0; > 11: DSA drops keys
    pos = pos[:, :12]
    model = load_hf_model(ckpt, load_mtp=True)
    export = [(n, t.clone()) for bucket in export_hf(model) for n, t in bucket]
    single = forward_backward_single(model, ids, pos)
    assert single["mtp_loss"] > 1.0 and single["loss"] > 1.0
    torch.save(dict(ids=ids, pos=pos, grads=grads_by_hf_name(model), export=export, **single), tmp_path / "ref.pt")
    spawn_ranks(run, 2, ckpt, str(tmp_path / "ref.pt"), ["tp2", "ep2", "pp2", "cp2"])


def test_full_recompute_gives_the_same_mtp_logits_and_grads(ckpts):
    """megatron's full-layer recompute (the MTP layer checkpointed with its indexer selection recomputed) gives the
    plain forward's MTP logits and grads exactly."""
    from slime.backends.megatron import load_hf_model

    ids, pos = _batch(11)
    results = []
    for overrides in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        model = load_hf_model(ckpts["glm5_next_text"], load_mtp=True, **overrides)
        _, (mtp,) = model(ids, pos, mtp_logits=True)
        (mtp * mtp.detach()).sum().backward()
        results.append((mtp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert any(n.startswith("mtp.") for n in ga)


def test_torch_dist_round_trip_with_the_mtp_layer_needs_no_extra_flag(ckpts, tmp_path):
    """A torch_dist checkpoint of the model with its MTP layer (the MTP tensors under megatron's `mtp.` names)
    converts back to the multimodal HF checkpoint bit for bit with convert_torch_dist_to_hf's plain flags: the MTP
    layer from the checkpoint, the vision tower from --origin-hf-dir."""
    from test_checkpoint_interchange import _digest

    from slime.backends.megatron import load_hf_model
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.convert import torch_dist_to_hf

    src = ckpts["glm5_next"]
    C.save(str(tmp_path / "td"), 0, load_hf_model(src, load_mtp=True), None, 0,
           {"world_size": 1, "tp": 1, "ep": 1, "pp": 1}, {})
    out = str(tmp_path / "hf")
    torch_dist_to_hf(["--input-dir", str(tmp_path / "td"), "--output-dir", out, "--origin-hf-dir", src])
    assert _digest(out) == _digest(src)
