"""GLM-5.3-Flash's MTP layer (slime_plugins/models/glm5_next/mtp.py) on tiny checkpoints saved by transformers with the
MTP layer added as the published one is stored (tests/glm5_next_helpers.add_mtp_layer: layer N, no hc_*). Its
logits, loss and grads against the float64 reference built from transformers' modules, and its 2-rank layouts
(tp2, ep2, pp2, cp2) against the single rank, are the conformance suite's glm5_next_mtp case
(tests/test_model_conformance.py, tests/glm5_next_mtp_reference.py). Here what is the family's own:
- full recompute gives the same MTP logits and grads, bit for bit;
- load_mtp keeps the vision tower and gives every tensor back bit for bit (export_hf); an MTP layer with
  tensors the layer does not have (hc_*) is refused in one line; a torch_dist checkpoint with the MTP layer converts
  back to the multimodal checkpoint bit for bit without -a (vision tower from --origin-hf-dir).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from glm5_next_helpers import add_mtp_layer, hf_reference, save_checkpoints
from safetensors.torch import load_file, save_file

SMOOTH = dict(swiglu_limit=10.0)  # grads compared away from the clamp's edges (tests/test_glm5_next_family.py SMOOTH)
SHAPE = (2, 13)  # 13 > index_topk + kpool - 1 = 11: the main DSA layers and the MTP layer's indexer drop keys


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
