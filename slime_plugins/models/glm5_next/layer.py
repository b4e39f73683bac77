"""The GLM-5.3-Flash decoder layer: mHC around the token mixer (KDA or DSA) and around the MLP (dense or MoE,
SwiGLU clamped at `swiglu_limit`), with transformers' Glm5NextTextDecoderLayer's op order.

megatron's TransformerLayer adds one residual stream per block, so this layer takes its place in the
TransformerBlock: built from a ModuleSpec as (config, layer_number, arch, pg_collection, vp_stage), called with
megatron's layer keywords, returns (hidden_states, context). Hidden states are [S(/tp), B, hc * H]
(slime_plugins/models/glm5_next/hyper.py); the first decoder layer expands the embedding's [S(/tp), B, H].
"""

from __future__ import annotations

import importlib

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import make_viewless_tensor

from slime_plugins.models.common.layers import RMSNorm, SwiGLUMLP
from slime_plugins.models.common.moe import GroupedExperts, MoELayer
from slime_plugins.models.glm5_next.config import INDEXED, LINEAR
from slime_plugins.models.glm5_next.hyper import HyperConnection, expand_streams, merge_streams

# token mixer of each layer type: (module, class), imported when a layer of that type is built
MIXERS = {LINEAR: ("slime_plugins.models.glm5_next.kda", "KimiDeltaAttention"),
          INDEXED: ("slime_plugins.models.glm5_next.attention", "NopeMlaDsaAttention")}


def mixer_class(arch, layer: int) -> type:
    module, name = MIXERS[arch.layer_types[layer]]
    return getattr(importlib.import_module(module), name)


def clamp_swiglu(mlp: torch.nn.Module, limit: float | None) -> None:
    """gate <= limit and -limit <= up <= limit before every SwiGLU of `mlp` (experts and shared expert too)."""
    for module in mlp.modules():
        if isinstance(module, (SwiGLUMLP, GroupedExperts)):
            module.swiglu_limit = limit


def build_mlp(config, arch, layer: int) -> MegatronModule:
    mlp = MoELayer(config, arch) if arch.mlp_type(layer) == "sparse" else SwiGLUMLP(config, arch.intermediate_size)
    clamp_swiglu(mlp, arch.swiglu_limit)
    return mlp


class Glm5NextDecoderLayer(MegatronModule):
    """Submodules (megatron names): hc_attn, input_layernorm, self_attention, hc_ffn, pre_mlp_layernorm, mlp."""

    def __init__(self, config, layer_number: int, arch, pg_collection=None, vp_stage: int | None = None,
                 **_: object) -> None:
        super().__init__(config=config)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        pp_group = getattr(pg_collection, "pp", None)  # megatron's TransformerBlock passes its groups
        pp_rank = pp_group.rank() if pp_group is not None else ps.get_pipeline_model_parallel_rank()
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)  # global, 1-based
        self.layer_index = self.layer_number - 1
        self.arch, self.hc = arch, arch.hc_mult
        sp, dtype = config.sequence_parallel, config.params_dtype
        self.hc_attn = HyperConnection(arch, dtype, sp)
        self.input_layernorm = RMSNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)
        self.self_attention = mixer_class(arch, self.layer_index)(config, self.layer_number, arch)
        self.hc_ffn = HyperConnection(arch, dtype, sp)
        self.pre_mlp_layernorm = RMSNorm(config, arch.hidden_size, eps=arch.rms_norm_eps)
        self.mlp = build_mlp(config, arch, self.layer_index)
        modules = set(config.recompute_modules or ()) if config.recompute_granularity == "selective" else set()
        self.recompute_mlp = ("moe" if isinstance(self.mlp, MoELayer) else "mlp") in modules

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)[0]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context=None, packed_seq_params=None,
                **_: object):
        x = hidden_states
        if self.layer_index == 0:
            x = expand_streams(x, self.hc)
        streams = x.view(*x.shape[:-1], self.hc, self.arch.hidden_size)
        post, comb, block_in = self.hc_attn(streams)
        out, _ = self.self_attention(self.input_layernorm(block_in), attention_mask=attention_mask,
                                     packed_seq_params=packed_seq_params)
        streams = merge_streams(out, post, comb, streams)
        post, comb, block_in = self.hc_ffn(streams)
        block_in = self.pre_mlp_layernorm(block_in)
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            out = tensor_parallel.checkpoint(self._mlp, False, block_in)
        else:
            out = self._mlp(block_in)
        streams = merge_streams(out, post, comb, streams)
        # a pipeline stage's output is freed after its send, which megatron refuses for a view
        out = make_viewless_tensor(streams.flatten(-2), requires_grad=streams.requires_grad, keep_graph=True)
        return out, context
