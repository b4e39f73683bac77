"""Grouped-query self-attention (Llama, Qwen2/3, Qwen3-MoE, GLM-4.5/4.6/4.7) from megatron's parallel
linear layers: optional q/k/v (and o) biases, optional per-head QK RMSNorm, rotary embedding on the first
`rotary_dim` features of each head (NeoX half pairs; partial rotary for GLM-4.5), causal attention through
`ops.attention` (GQA: query head h reads key/value head h // (Hq / Hkv)).

TP: query and key/value heads are split over TP ranks (q/k/v column-parallel, o row-parallel). With
sequence parallel the layer gathers the full sequence once at its input; the backward of that gather
reduce-scatters the input grad, so q/k/v do not reduce it themselves. The QK-norm weights see only this
rank's heads: their grads are summed over TP (marked `sequence_parallel`, megatron's rule).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime_plugins.models.common.context_parallel import gather_sequence, key_rows
from slime_plugins.models.common.layers import RMSNorm, from_thd, row_parallel, to_thd
from slime_plugins.models.common.rope import ForwardContext


def _heads_projection(config, in_features: int, out_features: int, bias: bool) -> ColumnParallelLinear:
    """Column-parallel projection of full (already gathered) tokens whose input grad the caller reduces."""
    layer = ColumnParallelLinear(in_features, out_features, config=config, init_method=config.init_method, bias=bias,
                                 gather_output=False, skip_bias_add=False, disable_grad_reduce=True)
    layer.sequence_parallel = False  # the input is the gathered sequence
    return layer


class GQASelfAttention(MegatronModule):
    """Megatron self-attention submodule: forward(hidden [S(/tp), B, H], ..., packed_seq_params=ForwardContext)
    -> (output [S(/tp), B, H], None). Reads from `arch`: num_attention_heads, num_key_value_heads, head_dim,
    rotary_dim, qkv_bias, o_bias, qk_norm, rms_norm_eps."""

    def __init__(self, config, layer_number: int, arch, **_: object) -> None:
        super().__init__(config=config)
        self.arch = arch
        tp = config.tensor_model_parallel_size
        self.heads, self.kv_heads, d = arch.num_attention_heads // tp, arch.num_key_value_heads // tp, arch.head_dim
        h = arch.hidden_size
        self.q_proj = _heads_projection(config, h, arch.num_attention_heads * d, arch.qkv_bias)
        self.k_proj = _heads_projection(config, h, arch.num_key_value_heads * d, arch.qkv_bias)
        self.v_proj = _heads_projection(config, h, arch.num_key_value_heads * d, arch.qkv_bias)
        self.o_proj = row_parallel(config, arch.num_attention_heads * d, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(config, d, eps=arch.rms_norm_eps)
            self.k_norm = RMSNorm(config, d, eps=arch.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full tokens [T, H] -> this rank's q [T, heads, d], k and v [T, kv_heads, d], QK-normed per head."""
        d = self.arch.head_dim
        q = self.q_proj(x)[0].view(-1, self.heads, d)
        k = self.k_proj(x)[0].view(-1, self.kv_heads, d)
        v = self.v_proj(x)[0].view(-1, self.kv_heads, d)
        if self.arch.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("GQASelfAttention needs the model's ForwardContext as packed_seq_params (use the DecoderModel)")
        arch, ops = self.arch, get_accelerator().ops
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        x = to_thd(x)  # [T, H]
        d = arch.head_dim
        q, k, v = self.project_qkv(x)
        q = ops.apply_rotary(q, ctx.cos, ctx.sin, rotary_dim=arch.rotary_dim, interleaved=arch.rope_interleaved)
        k = ops.apply_rotary(k, ctx.cos, ctx.sin, rotary_dim=arch.rotary_dim, interleaved=arch.rope_interleaved)
        if ctx.cp is not None:  # context parallel: keys and values of the whole causal prefix
            kv = key_rows(gather_sequence(torch.cat([k, v], dim=-1), ctx.cp), ctx.cp)
            k, v = kv.split([d, d], dim=-1)
        out = ops.attention(q, k, v, ctx.cu_seqlens, ctx.key_segments(), causal=True, softmax_scale=d ** -0.5)
        out = from_thd(out.reshape(out.shape[0], -1), ctx.seq_len, ctx.batch)
        out, _ = self.o_proj(out)
        return out, None
