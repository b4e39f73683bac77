"""GLM-5.3-Flash HF names <-> megatron parameters, under the checkpoint's on-disk names: per-expert tensors,
`hc_attn_fn` / `hc_attn_base` / `hc_attn_scale` and `hc_ffn_*` per layer, the text model under `model.` (flat
`glm5_next_text`) or `model.language_model.` (the multimodal `glm5_next`, whose vision tower `model.visual.*`
and untrained MTP layers are kept unchanged: `arch.kept_hf_prefixes`; trained MTP layers: mtp.py). The token
mixers' maps come from their modules (kda.py, attention.py)."""

from __future__ import annotations

import dataclasses
import importlib

from slime_plugins.models.common.weights import REPLICATED, WeightMap, mlp_maps, model_maps, stage_of
from slime_plugins.models.glm5_next.config import INDEXED, LINEAR

# the weight maps of each token mixer: (module, function(arch, layer, prefix, hf_prefix))
MIXER_MAPS = {LINEAR: ("slime_plugins.models.glm5_next.kda", "kda_weight_maps"),
              INDEXED: ("slime_plugins.models.glm5_next.attention", "dsa_weight_maps")}


def hyper_connection_maps(prefix: str, hf_prefix: str) -> list[WeightMap]:
    return [WeightMap(f"{prefix}.hc_{block}.{part}", (f"{hf_prefix}.hc_{block}_{part}",), REPLICATED)
            for block in ("attn", "ffn") for part in ("fn", "base", "scale")]


def mixer_maps(arch, layer: int, prefix: str, hf_prefix: str) -> list[WeightMap]:
    module, name = MIXER_MAPS[arch.layer_types[layer]]
    fn = getattr(importlib.import_module(module), name)
    if arch.is_linear(layer):
        return fn(arch, f"{prefix}.self_attention", f"{hf_prefix}.self_attn")
    return fn(arch, layer, f"{prefix}.self_attention", f"{hf_prefix}.self_attn")


def layer_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    maps = mlp_maps(arch, layer, prefix, hf_prefix, ep_rank, ep)
    # checkpoint order: hc, norms, token mixer, MLP
    return hyper_connection_maps(prefix, hf_prefix) + maps[:2] + mixer_maps(arch, layer, prefix, hf_prefix) + maps[2:]


def _text_prefixed(arch, maps: list[WeightMap]) -> list[WeightMap]:
    """The multimodal checkpoint keeps the text model under `model.language_model.` (lm_head stays top-level)."""
    if arch.hf_prefix == "model":
        return maps

    def rename(name: str) -> str:
        return arch.hf_prefix + name[len("model"):] if name.startswith("model.") else name

    return [dataclasses.replace(m, hf=tuple(rename(n) for n in m.hf), expert_prefix=rename(m.expert_prefix))
            for m in maps]


def hf_names(arch) -> list[str]:
    """Every HF tensor name of the trained model (no vision tower, no MTP), in export order."""
    maps = model_maps(arch, layer_maps, 0, arch.num_hidden_layers, True, True)
    return [n for m in _text_prefixed(arch, maps) for n in m.hf]


def maps_for_model(model) -> list[WeightMap]:
    """Maps of this rank's model shard (its pipeline stage and expert-parallel rank), MTP block included."""
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    maps = _text_prefixed(model.arch, model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep))
    if getattr(model, "mtp", None) is not None:
        from slime_plugins.models.glm5_next.mtp import embedding_copy_map, mtp_maps

        maps += mtp_maps(model.arch, ep_rank, ep)  # under the text prefix already
        if model.holds_embedding_copy:
            maps.append(embedding_copy_map(model.arch))
    return maps
