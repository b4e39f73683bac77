"""The MiniMax-M2 model: the shared DecoderModel with GQA attention whose q and k projections are RMS-normed over
all heads at once (transformers' MiniMaxM2Attention: q_norm over num_heads x head_dim, k_norm over
num_kv_heads x head_dim, before rotary) and MoE layers in the HF layout `block_sparse_moe.experts.{e}.w1|w3|w2`.

TP: each rank holds its heads' slice of q / k, so the norm gathers the slice over TP, normalises the full width
and keeps its slice again (upstream slime's MiniMaxM2SelfAttention does the same). Every TP rank then computes
the same norm-weight grads: the weights are replicated, not summed over TP."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel

from slime_plugins.models.common import model as common
from slime_plugins.models.common.gqa_attention import GQASelfAttention
from slime_plugins.models.common.gqa_model import attention_maps
from slime_plugins.models.common.layers import RMSNorm
from slime_plugins.models.common.weights import REPLICATED, WeightMap, all_hf_names, mlp_maps, model_maps, stage_of


class MiniMaxM2SelfAttention(GQASelfAttention):
    def __init__(self, config, layer_number: int, arch, **kwargs: object) -> None:
        super().__init__(config, layer_number, arch, **kwargs)
        d = arch.head_dim
        self.q_norm = RMSNorm(config, arch.num_attention_heads * d, eps=arch.rms_norm_eps, sequence_parallel=False)
        self.k_norm = RMSNorm(config, arch.num_key_value_heads * d, eps=arch.rms_norm_eps, sequence_parallel=False)

    def _full_width_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self.config.tensor_model_parallel_size == 1:
            return norm(x)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(x)  # backward: this rank's slice
        return tensor_parallel.scatter_to_tensor_model_parallel_region(norm(full))  # backward: all-gather

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.arch.head_dim
        q = self._full_width_norm(self.q_proj(x)[0], self.q_norm).view(-1, self.heads, d)
        k = self._full_width_norm(self.k_proj(x)[0], self.k_norm).view(-1, self.kv_heads, d)
        v = self.v_proj(x)[0].view(-1, self.kv_heads, d)
        return q, k, v


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized)."""
    return common.build_model(arch, MiniMaxM2SelfAttention, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              **config_overrides)


def _mixtral_names(m: WeightMap) -> WeightMap:
    """The shared MoE maps under MiniMax-M2's checkpoint names (transformers' Mixtral layout)."""
    def rename(name: str) -> str:
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f".{ours}.weight", f".{theirs}.weight")
        return name.replace(".mlp.", ".block_sparse_moe.")

    return dataclasses.replace(m, hf=tuple(rename(n) for n in m.hf), expert_prefix=rename(m.expert_prefix),
                               expert_names=("w1", "w3", "w2"))


def layer_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    a, h = f"{prefix}.self_attention", f"{hf_prefix}.self_attn"
    norms_and_moe = mlp_maps(arch, layer, prefix, hf_prefix, ep_rank, ep)
    return [*norms_and_moe[:2], *attention_maps(arch, prefix, hf_prefix),
            WeightMap(f"{a}.q_norm.weight", (f"{h}.q_norm.weight",), REPLICATED),
            WeightMap(f"{a}.k_norm.weight", (f"{h}.k_norm.weight",), REPLICATED),
            *(_mixtral_names(m) for m in norms_and_moe[2:])]


def hf_names(arch) -> list[str]:
    return all_hf_names(arch, layer_maps)


def maps_for_model(model) -> list[WeightMap]:
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    return model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep)
