"""Weight names for SGLang 0.5.23's glm5_next loader (tests/data/sglang_0.5.23_glm5_next_names.json, read from the
wheel): its load_weights replayed on checkpoint names, against the parameters its modules build for a config.

- every tensor of a tiny Glm5NextForConditionalGeneration checkpoint saved by transformers (the on-disk names)
  lands on a parameter of SGLang's model, and every parameter gets a tensor;
- every name the glm5_next family's hf_names() emits (what the trainer sends in a weight sync) does too
  (skipped, saying so, while the family is not registered);
- the MTP layer as the published checkpoint stores it (layer num_hidden_layers: enorm, hnorm, eh_proj,
  shared_head.norm and one DSA + MoE decoder layer; no hc_*, no embed_tokens / shared_head.head copies) reaches
  the draft model (Glm5NextForConditionalGenerationNextN, whose decoder is DeepseekV2DecoderLayer: no mHC
  parameters), every tensor on a parameter and every draft parameter but the shared embedding / head filled;
  the family's mtp_names (what the trainer sends an engine that runs the draft) are exactly those names;
- names SGLang would drop silently (transformers' in-memory names, a config without "mhc": true) are caught.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = json.loads((Path(__file__).parent / "data/sglang_0.5.23_glm5_next_names.json").read_text())
FUSED_TARGETS = {".fused_qkvbfg_a_proj", ".fused_bfg_a_proj", ".fused_fg_b_proj", ".qkv_proj", ".qkv_conv1d"}


def sglang_parameters(text: dict, vision: dict | None, mhc: bool = True) -> set[str]:
    """Parameter names of SGLang's Glm5NextForConditionalGeneration (the default build) for a config."""
    p = DATA["parameters"]
    out = set(p["top"])
    for i in range(text["num_hidden_layers"]):
        groups = ["layer"] + (["mhc"] if mhc else [])
        if text["layer_types"][i] == "linear_attention":
            groups.append("kda")
        else:
            groups += ["mla"] + ([] if text["indexer_types"][i] == "shared" else ["indexer"])
        groups.append("dense_mlp" if text["mlp_layer_types"][i] == "dense" else "moe")
        out |= {t.format(i=i) for g in groups for t in p[g]}
    if vision:
        out |= set(p["vision_top"]) | {t.format(b=b) for b in range(vision["depth"]) for t in p["vision_block"]}
    return out


def nextn_parameters() -> set[str]:
    """The draft model: embedding, enorm / hnorm / eh_proj, shared_head.norm, lm_head, and one MLA + indexer + MoE
    decoder layer under model.decoder (no mHC)."""
    p = DATA["parameters"]
    layer = {t.format(i=0).replace("model.layers.0.", "model.decoder.")
             for g in ("mla", "indexer", "moe") for t in p[g]}
    return set(DATA["nextn"]["parameters"]) | layer


def replay(name: str, params: set[str], n_layers: int, n_experts: int, nextn: bool = False) -> str | None:
    """SGLang's load_weights for one checkpoint name: the parameter it loads, or None where it drops the tensor.
    Follows the code's order, including that a rejected candidate name is carried into the next rule."""
    for old, new in DATA["rename"]["replace_in_order"]:
        name = name.replace(old, new)
    if "visual" in name:
        for old, new in DATA["rename"]["vision_only"]:
            name = name.replace(old, new)
    if not nextn:
        parts = name.split(".")
        if name.startswith("model.layers") and len(parts) >= 3 and int(parts[2]) >= n_layers:
            return None  # the MTP layer: the draft model's
    else:
        prefix = f"model.layers.{n_layers}"
        if not name.startswith(prefix) or any(s in name for s in DATA["nextn"]["skip"]):
            return None
        spec = any(w in name for w in DATA["nextn"]["to_model"])
        name = name.replace(prefix, "model" if spec else "model.decoder")
    if any(s in name for s in DATA["skip"]["substrings"]):
        return None
    for param, weight, _ in DATA["stacked_params_mapping"]:
        if weight not in name or "mlp.experts" in name:
            continue
        candidate = name.replace(weight, param)
        if param in FUSED_TARGETS and candidate not in params:
            continue
        name = candidate
        if name not in params:
            continue
        return name
    is_expert = False
    emap = DATA["expert_params_mapping"]
    for e in range(n_experts):
        for proj in ("gate_proj", "down_proj", "up_proj"):
            weight = emap["weight_name"].format(e=e, proj=proj)
            if weight not in name:
                continue
            is_expert = True
            name = name.replace(weight, emap["param_name"][proj])
            if name in params:
                return name
    if is_expert:
        return None
    for part, fused in DATA["fused_qkv_a_proj"].items():
        if part in name and part != "note":
            target = name.replace(part, fused)
            return target if target in params else None
    return name if name in params else None


def _tensor_names(path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    """A tiny multimodal checkpoint saved by transformers."""
    from transformers import Glm5NextForConditionalGeneration

    from slime_plugins.models.glm5_next.tiny import tiny_config

    path = tmp_path_factory.mktemp("glm5_next_tiny")
    Glm5NextForConditionalGeneration(tiny_config("glm5_next")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(saved_dir):
    """(config.json, tensor names) of the checkpoint saved by transformers."""
    return json.loads((saved_dir / "config.json").read_text()), _tensor_names(saved_dir)


@pytest.fixture(scope="module")
def mtp_on_disk(saved_dir, tmp_path_factory) -> set[str]:
    """The MTP layer's tensor names once it is added to the checkpoint as the published one is stored
    (tests/glm5_next_helpers.add_mtp_layer, the writer of every MTP test's checkpoint)."""
    import shutil

    from glm5_next_helpers import add_mtp_layer

    path = tmp_path_factory.mktemp("glm5_next_mtp") / "ckpt"
    shutil.copytree(saved_dir, path)
    add_mtp_layer(path)
    n = json.loads((path / "config.json").read_text())["text_config"]["num_hidden_layers"]
    return {name for name in _tensor_names(path) if name.startswith(f"model.language_model.layers.{n}.")}


def _tiny(saved, mhc: bool = True):
    """The checkpoint with its config.json as SGLang reads it ("mhc" stated or not)."""
    cfg, names = saved
    cfg = json.loads(json.dumps(cfg))
    cfg["text_config"]["mhc"] = mhc
    return cfg, names


def _loaded(names, params, text) -> dict[str, str | None]:
    return {n: replay(n, params, text["num_hidden_layers"], text["n_routed_experts"]) for n in names}


def test_data_names_the_version_and_files():
    assert DATA["sglang_version"] == "0.5.23" and DATA["wheel"].startswith("sglang-0.5.23-")
    assert len(DATA["wheel_sha256"]) == 64
    assert {"sglang/srt/models/glm5_next.py", "sglang/srt/models/glm5_next_nextn.py"} <= set(DATA["files"])


def test_checkpoint_saved_by_transformers_fills_every_sglang_parameter(saved):
    cfg, names = _tiny(saved)
    text = cfg["text_config"]
    params = sglang_parameters(text, cfg["vision_config"])
    loaded = _loaded(names, params, text)
    dropped = sorted(n for n, p in loaded.items() if p is None)
    assert not dropped, dropped
    assert set(loaded.values()) == params  # and nothing of SGLang's model is left without a tensor
    # spot checks of the rules: KDA's six input projections into one, the convs, experts, the merged a-projections
    kda = "model.language_model.layers.0.self_attn."
    assert {loaded[kda + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")} == {
        "model.layers.0.self_attn.fused_qkvbfg_a_proj.weight"}
    assert loaded[kda + "k_conv1d.weight"] == "model.layers.0.self_attn.qkv_conv1d.weight"
    assert loaded["model.language_model.layers.2.mlp.experts.7.up_proj.weight"] == "model.layers.2.mlp.experts.w13_weight"
    assert loaded["model.language_model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] == \
        "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert loaded["model.visual.blocks.0.attn.qkv.bias"] == "visual.blocks.0.attn.qkv_proj.bias"
    assert "model.layers.3.self_attn.indexer.wk.weight" not in params  # the shared DSA layer has no indexer


def test_names_sglang_would_drop_are_caught(saved):
    """transformers' in-memory names and a config.json without "mhc": true lose tensors silently in SGLang."""
    cfg, names = _tiny(saved, mhc=False)
    text = cfg["text_config"]
    params = sglang_parameters(text, cfg["vision_config"], mhc=False)
    loaded = _loaded(names, params, text)
    assert {n for n, p in loaded.items() if p is None} == {n for n in names if ".hc_" in n} != set()
    full = sglang_parameters(text, cfg["vision_config"])
    for wrong in ("model.language_model.layers.0.self_attn.conv1d.weight",  # transformers fuses the convs in memory
                  "model.language_model.layers.0.self_attn.forget_gate.f_a_proj.weight",
                  "model.language_model.layers.0.attn_hc.fn",
                  "model.language_model.layers.1.mlp.experts.gate_up_proj"):  # transformers' fused experts
        assert replay(wrong, full, text["num_hidden_layers"], text["n_routed_experts"]) is None, wrong


def test_the_mtp_layer_is_stored_without_mhc_or_copies(saved, mtp_on_disk):
    """The published MTP layer (layer 45 of GLM-5.3-Flash): its own enorm / hnorm / eh_proj / shared_head.norm and
    a full DSA MoE decoder layer's tensors (here those of layer 2) without hc_*: SGLang's draft decoder is a
    DeepseekV2DecoderLayer, which has no mHC; the draft takes the embedding and the LM head from the target, and
    the checkpoint keeps no embed_tokens / shared_head.head copies under the layer."""
    cfg, names = saved
    n = cfg["text_config"]["num_hidden_layers"]
    dsa, mtp = "model.language_model.layers.2.", f"model.language_model.layers.{n}."
    decoder = {mtp + name[len(dsa):] for name in names if name.startswith(dsa) and ".hc_" not in name}
    own = {mtp + p for p in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")}
    assert mtp_on_disk == decoder | own
    assert any(".hc_" in name for name in names if name.startswith(dsa))  # the main layers do carry mHC


def test_mtp_layer_reaches_the_draft_model(saved, mtp_on_disk):
    """Every tensor of the MTP layer lands on a draft-model parameter (its own projections and norms at the draft's
    top, its MLA, indexer and MoE under model.decoder) and fills every draft parameter but the embedding and LM
    head it shares with the target; the main model skips the whole layer. hc_* tensors under the layer would be
    dropped silently (the draft has no mHC), which is why loading such a checkpoint for training fails
    (tests/test_glm5_next_mtp.py)."""
    cfg, _ = _tiny(saved)
    text = cfg["text_config"]
    n, experts = text["num_hidden_layers"], text["n_routed_experts"]
    draft = nextn_parameters()
    loaded = {m: replay(m, draft, n, experts, nextn=True) for m in mtp_on_disk}
    assert sorted(m for m, p in loaded.items() if p is None) == []
    assert set(loaded.values()) == draft - {"model.embed_tokens.weight", "lm_head.weight"}  # shared with the target
    assert loaded[f"model.language_model.layers.{n}.shared_head.norm.weight"] == "model.shared_head.norm.weight"
    assert loaded[f"model.language_model.layers.{n}.mlp.experts.3.down_proj.weight"] == "model.decoder.mlp.experts.w2_weight"
    main = sglang_parameters(text, cfg["vision_config"])
    assert all(replay(m, main, n, experts) is None for m in mtp_on_disk)
    for part in ("attn_fn", "attn_base", "attn_scale", "ffn_fn", "ffn_base", "ffn_scale"):
        assert replay(f"model.language_model.layers.{n}.hc_{part}", draft, n, experts, nextn=True) is None, part


def _family_arch(model_type: str):
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    from slime_plugins.models.glm5_next.tiny import tiny_config

    try:
        family = get_family(model_type)
    except UnsupportedModelError:
        pytest.skip("the glm5_next model family is not registered yet (slime_plugins/models/glm5_next/__init__.py "
                    "defines no FAMILY): its hf_names cannot be checked")
    cfg = tiny_config(model_type).to_dict()
    cfg["text_config"]["num_nextn_predict_layers"] = 1  # the published checkpoint's one MTP layer
    return family, family.parse(cfg), cfg


def test_family_sender_names_map_to_sglang_parameters(mtp_on_disk):
    """Every name the trainer sends (the family's hf_names: text model, no vision) lands on a parameter, and the
    MTP names it sends an engine that runs the draft (mtp_names) are the checkpoint's MTP layer exactly, each on a
    draft parameter."""
    family, arch, cfg = _family_arch("glm5_next")
    text = cfg["text_config"] | {"mhc": True}
    params = sglang_parameters(text, cfg["vision_config"])
    sent = family.call("hf_names", arch)
    loaded = _loaded(sent, params, text)
    assert not [n for n, p in loaded.items() if p is None]
    vision = {p for p in params if p.startswith("visual.")}
    assert set(loaded.values()) == params - vision  # the frozen vision tower is the only part not sent
    assert family.supports_mtp
    names, aliases = family.call("mtp_names", arch)
    assert aliases == {} and len(names) == len(set(names)) and set(names) == mtp_on_disk
    n, experts = text["num_hidden_layers"], text["n_routed_experts"]
    draft = nextn_parameters()
    to_draft = {m: replay(m, draft, n, experts, nextn=True) for m in names}
    assert not [m for m, p in to_draft.items() if p is None]
    assert set(to_draft.values()) == draft - {"model.embed_tokens.weight", "lm_head.weight"}
