"""Model builder and HF weight maps of the grouped-query-attention families: the shared DecoderModel with
GQASelfAttention and dense SwiGLU / MoE layers. Every GQA family's FAMILY points here."""

from __future__ import annotations

import torch

from slime_plugins.models.common import model as common
from slime_plugins.models.common.gqa_attention import GQASelfAttention
from slime_plugins.models.common.weights import (REPLICATED, TP_COLS, TP_ROWS, WeightMap, all_hf_names, mlp_maps,
                                                 model_maps, stage_of)


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized)."""
    return common.build_model(arch, GQASelfAttention, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              **config_overrides)


def attention_maps(arch, prefix: str, hf_prefix: str) -> list[WeightMap]:
    a, h = f"{prefix}.self_attention", f"{hf_prefix}.self_attn"
    maps = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        maps.append(WeightMap(f"{a}.{proj}.weight", (f"{h}.{proj}.weight",), TP_ROWS))
        if arch.qkv_bias:
            maps.append(WeightMap(f"{a}.{proj}.bias", (f"{h}.{proj}.bias",), TP_ROWS))
    maps.append(WeightMap(f"{a}.o_proj.weight", (f"{h}.o_proj.weight",), TP_COLS))
    if arch.o_bias:
        maps.append(WeightMap(f"{a}.o_proj.bias", (f"{h}.o_proj.bias",), REPLICATED))
    if arch.qk_norm:
        maps += [WeightMap(f"{a}.q_norm.weight", (f"{h}.q_norm.weight",), REPLICATED),
                 WeightMap(f"{a}.k_norm.weight", (f"{h}.k_norm.weight",), REPLICATED)]
    return maps


def layer_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    maps = mlp_maps(arch, layer, prefix, hf_prefix, ep_rank, ep)
    return maps[:2] + attention_maps(arch, prefix, hf_prefix) + maps[2:]  # norms, attention, MLP


def hf_names(arch) -> list[str]:
    return all_hf_names(arch, layer_maps)


def maps_for_model(model) -> list[WeightMap]:
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    return model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep)
