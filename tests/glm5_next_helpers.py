"""Helpers of the GLM-5.3-Flash (glm5_next) tests: tiny checkpoints written by transformers (the multimodal one
and a flat text-only one with the same text weights), transformers' grads under the on-disk names, and
transformers' own KDA / DSA modules as token mixers of our decoder layer (the core's tests, independent of the
family's KDA and DSA)."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

SEED = 3


def hf_reference(seed: int = SEED, **overrides):
    """A tiny `Glm5NextForConditionalGeneration` (float32, eager attention, train mode) with non-trivial mHC
    base/scale, expert biases and norm weights (transformers initialises them to 0 / 1)."""
    from transformers import Glm5NextForConditionalGeneration

    from slime_plugins.models.glm5_next.tiny import tiny_config

    torch.manual_seed(seed)
    config = tiny_config("glm5_next", initializer_range=0.2, **overrides)
    config.text_config._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(config).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("hc.base", "hc.scale", "e_score_correction_bias", "norm.weight", "A_log", "dt_bias")):
                t.add_(0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return model.train()


def save_checkpoints(model, root) -> dict[str, str]:
    """{"glm5_next": the multimodal checkpoint (save_pretrained), "glm5_next_text": the flat text-only one
    (text fields at the top level, tensors under `model.`, no vision tower)} of `model`."""
    root = str(root)
    multimodal, flat = os.path.join(root, "glm5_next"), os.path.join(root, "glm5_next_text")
    model.save_pretrained(multimodal)
    tensors = load_file(os.path.join(multimodal, "model.safetensors"))
    prefix = "model.language_model."
    text = {("model." + n[len(prefix):] if n.startswith(prefix) else n): t for n, t in tensors.items()
            if not n.startswith("model.visual.")}
    os.makedirs(flat, exist_ok=True)
    save_file(text, os.path.join(flat, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.text_config.to_dict() | {"model_type": "glm5_next_text", "architectures": None}
    with open(os.path.join(flat, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return {"glm5_next": multimodal, "glm5_next_text": flat}


def hf_grads_on_disk(model) -> dict[str, torch.Tensor]:
    """transformers' grads under the checkpoint's on-disk names (conversion_mapping.py "glm5_next" reversed)."""
    from glm5_helpers import hf_grads_by_checkpoint_name

    return on_disk_names(hf_grads_by_checkpoint_name(model))


def on_disk_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Grads under transformers' in-memory names (experts split) -> under the checkpoint's on-disk names."""
    out = {}
    for name, grad in grads.items():
        name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        if name.endswith(".self_attn.conv1d.weight"):
            stem = name.removesuffix("conv1d.weight")
            for part, g in zip("qkv", grad.chunk(3, dim=0)):
                out[f"{stem}{part}_conv1d.weight"] = g
            continue
        out[name] = grad
    return out


def _text_config(arch):
    from transformers import Glm5NextTextConfig

    hf = arch.hf_config
    text = {k: v for k, v in (hf["text_config"] if "text_config" in hf else hf).items() if k != "model_type"}
    config = Glm5NextTextConfig(**text)
    config._attn_implementation = "eager"
    return config


class TransformersMixer(torch.nn.Module):
    """transformers' Glm5NextTextLinearAttention / Glm5NextTextAttention as a megatron self-attention submodule
    (TP 1, [S, B, H] in and out, one sequence per row); DSA top-k handed between layers through the
    ForwardContext as transformers hands it."""

    def __init__(self, config, layer_number: int, arch, **_: object) -> None:
        super().__init__()
        from transformers.models.glm5_next import modeling_glm5_next as hf

        self.index, self.linear = layer_number - 1, arch.is_linear(layer_number - 1)
        cls = hf.Glm5NextTextLinearAttention if self.linear else hf.Glm5NextTextAttention
        self.hf = cls(_text_config(arch), self.index).to(config.params_dtype)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_: object):
        x = hidden_states.transpose(0, 1)
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
        if self.linear:
            return self.hf(x, attention_mask=mask).transpose(0, 1), None
        out, _, topk = self.hf(x, attention_mask=mask, prev_topk_indices=packed_seq_params.topk.get(self.index - 1))
        packed_seq_params.topk[self.index] = topk
        return out.transpose(0, 1), None


def use_transformers_mixers(monkeypatch, model) -> dict[str, torch.Tensor]:
    """Build layers with TransformersMixer and map its tensors to `mixer.{layer}.{name}`; returns those tensors
    of `model` (transformers' in-memory names) for a loader to add to the checkpoint's."""
    from slime_plugins.models.common.weights import REPLICATED, WeightMap
    from slime_plugins.models.glm5_next import layer as layer_module
    from slime_plugins.models.glm5_next import weights as weights_module

    names, tensors = {}, {}
    for i, layer in enumerate(model.model.language_model.layers):
        state = layer.self_attn.state_dict()
        names[i] = list(state)
        tensors.update({f"mixer.{i}.{n}": t.detach().clone() for n, t in state.items()})

    def maps(arch, layer, prefix, hf_prefix):
        return [WeightMap(f"{prefix}.self_attention.hf.{n}", (f"mixer.{layer}.{n}",), REPLICATED) for n in names[layer]]

    for kind in ("linear_attention", "indexed_attention"):
        monkeypatch.setitem(layer_module.MIXERS, kind, (__name__, "TransformersMixer"))
    monkeypatch.setattr(weights_module, "mixer_maps", maps)
    return tensors


def load_state(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF tensors into this rank's shard through the family's weight maps (TP 1)."""
    from slime_plugins.models.glm5_next.weights import maps_for_model

    state = model.state_dict(keep_vars=True)
    maps = maps_for_model(model)
    unmapped = {n for n in state if not n.endswith("._extra_state")} - {m.param for m in maps}
    assert not unmapped, unmapped
    with torch.no_grad():
        for m in maps:
            state[m.param].copy_(m.to_local([tensors[n] for n in m.hf], 0, 1))


def grads_by_hf_name(model, gather=None) -> dict[str, torch.Tensor]:
    """Our grads under HF names; `gather(grad, kind)` -> the shards of every rank (TP / EP > 1)."""
    from slime_plugins.models.glm5_next.weights import maps_for_model

    state = model.state_dict(keep_vars=True)
    out = {}
    for m in maps_for_model(model):
        grad = state[m.param].grad
        if grad is not None:
            shards = gather(grad, m.kind) if gather else [grad]
            out.update(zip(m.hf_names_after_gather(model.arch.n_routed_experts), m.to_hf(shards)))
    return out


def add_mtp_layer(path, seed: int = SEED) -> str:
    """Give a tiny glm5_next checkpoint (multimodal or flat) its MTP layer as the published one is stored: layer
    `num_hidden_layers` under the text prefix with enorm / hnorm / eh_proj / shared_head.norm and one DSA (NoPE MLA
    + k-pool indexer) MoE decoder layer without hc_* (the tensors of layer 2, a full DSA MoE layer, perturbed), and
    `num_nextn_predict_layers: 1` in the text config."""
    path = str(path)
    file = os.path.join(path, "model.safetensors")
    tensors, config = load_file(file), json.load(open(os.path.join(path, "config.json")))
    text = config.get("text_config") or config
    n, h = text["num_hidden_layers"], text["hidden_size"]
    prefix = "model.language_model.layers." if "text_config" in config else "model.layers."
    g = torch.Generator().manual_seed(seed)
    src, dst = f"{prefix}2.", f"{prefix}{n}."
    for name in [k for k in tensors if k.startswith(src) and ".hc_" not in k]:
        t = tensors[name]
        noise = 0.05 * torch.randn(t.shape, generator=g) * t.float().std().clamp(min=1e-3) if t.numel() > 1 else 0
        tensors[dst + name[len(src):]] = (t + noise).to(t.dtype)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[dst + name] = 1 + 0.3 * torch.randn(h, generator=g)
    tensors[dst + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    text["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
