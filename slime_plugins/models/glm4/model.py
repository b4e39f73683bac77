"""The GLM-4 model: the shared DecoderModel with GQA attention whose output is RMS-normed before the residual
(post_self_attn_layernorm) and a dense SwiGLU MLP whose output is too (post_mlp_layernorm), as transformers'
Glm4DecoderLayer. Both norms see sequence-parallel tokens (after o_proj / fc2 reduce-scatter), so their weight
grads are summed over TP (RMSNorm marks them). HF's MLP is one `gate_up_proj` tensor ([gate; up] rows)."""

from __future__ import annotations

import torch

from slime_plugins.models.common import model as common
from slime_plugins.models.common.gqa_attention import GQASelfAttention
from slime_plugins.models.common.gqa_model import attention_maps
from slime_plugins.models.common.layers import RMSNorm, SwiGLUMLP
from slime_plugins.models.common.weights import (REPLICATED, TP_COLS, TP_GATE_UP_FUSED, WeightMap, all_hf_names,
                                                 model_maps, stage_of)


class PostNormSwiGLUMLP(SwiGLUMLP):
    def __init__(self, config, ffn_hidden_size: int | None = None, **kwargs: object) -> None:
        super().__init__(config, ffn_hidden_size, **kwargs)
        self.post_mlp_layernorm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, x: torch.Tensor, padding_mask=None):
        out, bias = super().forward(x, padding_mask)
        return self.post_mlp_layernorm(out), bias


class Glm4SelfAttention(GQASelfAttention):
    dense_mlp = PostNormSwiGLUMLP  # read by common/spec.py

    def __init__(self, config, layer_number: int, arch, **kwargs: object) -> None:
        super().__init__(config, layer_number, arch, **kwargs)
        self.post_self_attn_layernorm = RMSNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **kwargs: object):
        out, bias = super().forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params, **kwargs)
        return self.post_self_attn_layernorm(out), bias


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized)."""
    return common.build_model(arch, Glm4SelfAttention, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              **config_overrides)


def layer_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    a, m, hm = f"{prefix}.self_attention", f"{prefix}.mlp", f"{hf_prefix}.mlp"
    return [
        WeightMap(f"{prefix}.input_layernorm.weight", (f"{hf_prefix}.input_layernorm.weight",), REPLICATED),
        WeightMap(f"{prefix}.pre_mlp_layernorm.weight", (f"{hf_prefix}.post_attention_layernorm.weight",), REPLICATED),
        *attention_maps(arch, prefix, hf_prefix),
        WeightMap(f"{a}.post_self_attn_layernorm.weight", (f"{hf_prefix}.post_self_attn_layernorm.weight",), REPLICATED),
        WeightMap(f"{m}.linear_fc1.weight", (f"{hm}.gate_up_proj.weight",), TP_GATE_UP_FUSED),
        WeightMap(f"{m}.linear_fc2.weight", (f"{hm}.down_proj.weight",), TP_COLS),
        WeightMap(f"{m}.post_mlp_layernorm.weight", (f"{hf_prefix}.post_mlp_layernorm.weight",), REPLICATED),
    ]


def hf_names(arch) -> list[str]:
    return all_hf_names(arch, layer_maps)


def maps_for_model(model) -> list[WeightMap]:
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    return model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep)
