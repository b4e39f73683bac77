"""HF names of the GLM-5 family's MLA (+ DSA indexer) attention; norms, MLP and MoE maps are shared
(common/weights.py)."""

from __future__ import annotations

from slime_plugins.models.common.weights import (REPLICATED, TP_COLS, TP_ROWS, WeightMap, all_hf_names, is_mtp_name,
                                                 mlp_maps, model_maps, stage_of)

__all__ = ["hf_names", "is_mtp_name", "layer_maps", "maps_for_model"]


def attention_maps(glm, layer: int, prefix: str, hf_prefix: str) -> list[WeightMap]:
    a, h = f"{prefix}.self_attention", f"{hf_prefix}.self_attn"
    maps = []
    if glm.q_lora_rank is None:
        maps.append(WeightMap(f"{a}.q_proj.weight", (f"{h}.q_proj.weight",), TP_ROWS))
    else:
        maps += [
            WeightMap(f"{a}.q_a_proj.weight", (f"{h}.q_a_proj.weight",), REPLICATED),
            WeightMap(f"{a}.q_a_layernorm.weight", (f"{h}.q_a_layernorm.weight",), REPLICATED),
            WeightMap(f"{a}.q_b_proj.weight", (f"{h}.q_b_proj.weight",), TP_ROWS),
        ]
    maps += [
        WeightMap(f"{a}.kv_a_proj_with_mqa.weight", (f"{h}.kv_a_proj_with_mqa.weight",), REPLICATED),
        WeightMap(f"{a}.kv_a_layernorm.weight", (f"{h}.kv_a_layernorm.weight",), REPLICATED),
        WeightMap(f"{a}.kv_b_proj.weight", (f"{h}.kv_b_proj.weight",), TP_ROWS),
        WeightMap(f"{a}.o_proj.weight", (f"{h}.o_proj.weight",), TP_COLS),
    ]
    if glm.attention_bias:
        if glm.q_lora_rank is not None:
            maps.append(WeightMap(f"{a}.q_a_proj.bias", (f"{h}.q_a_proj.bias",), REPLICATED))
        maps += [WeightMap(f"{a}.kv_a_proj_with_mqa.bias", (f"{h}.kv_a_proj_with_mqa.bias",), REPLICATED),
                 WeightMap(f"{a}.o_proj.bias", (f"{h}.o_proj.bias",), REPLICATED)]
    if glm.indexer_type(layer) == "full":
        for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
            maps.append(WeightMap(f"{a}.indexer.{name}", (f"{h}.indexer.{name}",), REPLICATED))
    return maps


def layer_maps(glm, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    """Maps of one decoder layer: megatron names under `prefix`, HF names under `hf_prefix`."""
    maps = mlp_maps(glm, layer, prefix, hf_prefix, ep_rank, ep)
    return maps[:2] + attention_maps(glm, layer, prefix, hf_prefix) + maps[2:]  # norms, attention, MLP


def hf_names(glm) -> list[str]:
    return all_hf_names(glm, layer_maps)


def maps_for_model(model) -> list[WeightMap]:
    """Maps of this rank's model shard (its pipeline stage and expert-parallel rank), MTP block included."""
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    maps = model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep)
    if getattr(model, "mtp", None) is not None:
        maps += mtp_maps(model.arch, ep_rank, ep)
        if model.holds_embedding_copy:  # MTP under PP: the last stage's embedding, under its MTP layer's HF name
            first_mtp = f"model.layers.{model.arch.num_hidden_layers}"
            maps.append(WeightMap("embedding.weight", (f"{first_mtp}.embed_tokens.weight",), TP_ROWS))
    return maps


def mtp_maps(glm, ep_rank: int, ep: int) -> list[WeightMap]:
    """Weight maps of the MTP block (the per-layer embed_tokens / shared_head.head copies are handled
    by the loader/exporter as aliases of the main embedding / output layer)."""
    from slime_plugins.models.common import weights as W

    maps = []
    for d in range(glm.mtp_num_layers):
        layer = glm.num_hidden_layers + d
        p, hp = f"mtp.layers.{d}", f"model.layers.{layer}"
        maps += [W.WeightMap(f"{p}.enorm.weight", (f"{hp}.enorm.weight",), W.REPLICATED),
                 W.WeightMap(f"{p}.hnorm.weight", (f"{hp}.hnorm.weight",), W.REPLICATED),
                 W.WeightMap(f"{p}.eh_proj.weight", (f"{hp}.eh_proj.weight",), W.REPLICATED),
                 W.WeightMap(f"{p}.final_layernorm.weight", (f"{hp}.shared_head.norm.weight",), W.REPLICATED)]
        maps += layer_maps(glm, layer, f"{p}.transformer_layer", hp, ep_rank, ep)
    return maps
