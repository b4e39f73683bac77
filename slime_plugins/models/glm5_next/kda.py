"""GLM-5.3-Flash's KDA layers (`linear_attention`): Kimi Delta Attention as transformers' Glm5NextTextLinearAttention
computes it, on whole packed sequences.

    q, k, v = silu(causal_conv(q_proj(x))), ... (depthwise, per sequence, float32 weights; ops.causal_conv1d)
    g       = ops.kda_gate(f_b_proj(f_a_proj(x)), A_log, dt_bias, linear_lower_bound)   per-channel log-decay
    beta    = sigmoid(b_proj(x))
    o       = ops.kda(q, k, v, g, beta)          (q, k L2-normalised in the op; the state restarts per sequence)
    out     = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))    (per head, float32)

Parameters carry the checkpoint's on-disk names (q_conv1d / k_conv1d / v_conv1d and the gate's f_a_proj, f_b_proj,
dt_bias, A_log directly under `self_attn`; transformers holds one `conv1d` and a `forget_gate` submodule in
memory). The convolutions, dt_bias and A_log stay float32 when the model is cast (transformers'
_keep_in_fp32_modules_strict).

Tensor parallel splits the heads: q/k/v/b/f_b/g_b projections column-parallel (their input grads all-reduced),
the rank's rows of the convolutions, dt_bias and A_log (weight-map kind TP_ROWS), o_proj row-parallel (TP_COLS;
it reduce-scatters under sequence parallel). The rank-1 down-projections f_a_proj and g_a_proj and o_norm's
weight are replicated (REPLICATED): f_a/g_a see the same full tokens on every rank (identical grads); o_norm
normalises only the rank's heads, so its weight enters through megatron's copy-to-TP-region, whose backward sums
its grad over the TP ranks. Sequence parallel gathers the TP ranks' tokens at the input. Context parallel
gathers every CP rank's chunks into whole sequences (the recurrence and the convolution need each sequence from
its first token), runs them on every CP rank and keeps the rank's own rows: the gather's backward sums the input
grads back to their owners, and the weights' grads (from the rank's own rows) sum over CP in the data-parallel
reduction, as every other weight's.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime_plugins.models.common.context_parallel import gather_sequence
from slime_plugins.models.common.layers import (KeepsFloat32, ReplicatedLinear, column_parallel, from_thd, row_parallel,
                                                to_thd)
from slime_plugins.models.common.rope import ForwardContext
from slime_plugins.models.common.tensor_parallel_attributes import mark_tensor_parallel
from slime_plugins.models.common.weights import REPLICATED, TP_COLS, TP_ROWS, WeightMap

__all__ = ["KimiDeltaAttention", "kda_weight_maps", "gated_rms_norm"]

ACTIVATION = "silu"  # transformers' config.hidden_act, which GLM-5.3-Flash's convolutions use
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
# (name, weight-map kind) in transformers' module order
PARAMETERS = (("q_proj.weight", TP_ROWS), ("k_proj.weight", TP_ROWS), ("v_proj.weight", TP_ROWS),
              ("q_conv1d.weight", TP_ROWS), ("k_conv1d.weight", TP_ROWS), ("v_conv1d.weight", TP_ROWS),
              ("f_a_proj.weight", REPLICATED), ("f_b_proj.weight", TP_ROWS), ("dt_bias", TP_ROWS), ("A_log", TP_ROWS),
              ("b_proj.weight", TP_ROWS), ("g_a_proj.weight", REPLICATED), ("g_b_proj.weight", TP_ROWS),
              ("o_norm.weight", REPLICATED), ("o_proj.weight", TP_COLS))


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Glm5NextTextRMSNormGated: rmsnorm over the head dim, the weight and sigmoid(gate) applied in
    float32 (float64 stays), cast back to o's dtype."""
    dtype = torch.float64 if o.dtype == torch.float64 else torch.float32
    of = o.to(dtype)
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(dtype) * normed * torch.sigmoid(gate.to(dtype))).to(o.dtype)


def whole_sequences(ctx: ForwardContext) -> torch.Tensor:
    """cu_seqlens (int32) of the whole sequences the layer runs: the context's own, or under context parallel the
    sequences gather_sequence rebuilds (each CP rank holds 2 of a sequence's 2 * CP equal chunks)."""
    if ctx.cp is None:
        return ctx.cu_seqlens
    lengths = [n * 2 * ctx.cp.size for n in torch.diff(ctx.cp.cu_seqlens_q).tolist()[0::2]]
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


class KimiDeltaAttention(KeepsFloat32, MegatronModule):
    """Megatron self-attention submodule of a KDA layer: forward(hidden_states [S(/tp), B, H], attention_mask=None,
    packed_seq_params=ForwardContext) -> (output [S(/tp), B, H], None)."""

    float32_names = tuple(f"{conv}.weight" for conv in CONVS) + ("dt_bias", "A_log")

    def __init__(self, config, layer_number: int, arch, **_: object) -> None:
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        if arch.linear_num_heads % tp:
            raise ValueError(f"linear_num_heads={arch.linear_num_heads} does not split over tp={tp}")
        self.arch = arch
        self.layer_index = layer_number - 1
        self.heads = arch.linear_num_heads // tp  # this rank's
        hidden, dim, dtype = arch.hidden_size, arch.linear_head_dim, config.params_dtype
        width = self.heads * dim
        exact = torch.float64 if dtype == torch.float64 else torch.float32  # float32 unless the model is float64

        def heads_projection(in_features: int, per_head: int = dim):
            return column_parallel(config, in_features, arch.linear_num_heads * per_head, sequence_parallel=False)

        self.q_proj, self.k_proj, self.v_proj = (heads_projection(hidden) for _ in range(3))
        for conv in CONVS:  # [width, 1, K] as on disk
            setattr(self, conv, torch.nn.Conv1d(width, width, arch.linear_conv_kernel_dim, groups=width, bias=False,
                                                dtype=exact))
        self.f_a_proj = ReplicatedLinear(hidden, dim, dtype=dtype)
        self.f_b_proj = heads_projection(dim)
        self.dt_bias = torch.nn.Parameter(torch.zeros(width, dtype=exact))
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads, dtype=exact))
        self.b_proj = heads_projection(hidden, per_head=1)
        self.g_a_proj = ReplicatedLinear(hidden, dim, dtype=dtype)
        self.g_b_proj = heads_projection(dim)
        self.o_norm = torch.nn.Module()
        self.o_norm.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))
        self.o_proj = row_parallel(config, arch.linear_dim, hidden)
        for param in (*(getattr(self, conv).weight for conv in CONVS), self.dt_bias, self.A_log):
            mark_tensor_parallel(param, 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's distributed-checkpoint view. The projections are megatron's parallel layers (their own TP
        axes); the convolutions, dt_bias and A_log hold this rank's rows, which megatron's default would store as
        replicas (TP rank 0's rows as the whole tensor): here they are split on their first axis over TP like a
        column-parallel weight, so the checkpoint holds every head and loads at any TP size."""
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in self.float32_names:
            key = f"{prefix}{name}"
            state[key] = make_tp_sharded_tensor_for_checkpoint(state[key].data, key, tp_axis=0,
                                                               prepend_offsets=sharded_offsets)
        return state

    def _heads(self, projection, x: torch.Tensor) -> torch.Tensor:
        out, _ = projection(x)
        return out.view(x.shape[0], self.heads, -1)

    def mix(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Whole packed sequences x [T, H] -> this rank's heads' normalised, gated output [T, heads * dim]."""
        arch, ops, t = self.arch, get_accelerator().ops, x.shape[0]
        qkv = torch.cat([self.q_proj(x)[0], self.k_proj(x)[0], self.v_proj(x)[0]], dim=-1)
        conv_weight = torch.cat([getattr(self, conv).weight[:, 0] for conv in CONVS])
        q, k, v = ops.causal_conv1d(qkv, conv_weight, cu_seqlens, ACTIVATION).view(t, 3 * self.heads, -1).chunk(3, 1)
        g = ops.kda_gate(self._heads(self.f_b_proj, self.f_a_proj(x)), self.A_log, self.dt_bias, arch.linear_lower_bound)
        beta = torch.sigmoid(self._heads(self.b_proj, x)[..., 0])
        o = ops.kda(q, k, v, g, beta, cu_seqlens)
        gate = self._heads(self.g_b_proj, self.g_a_proj(x))
        norm_weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.o_norm.weight)
        return gated_rms_norm(o, gate, norm_weight, arch.rms_norm_eps).reshape(t, -1)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("KimiDeltaAttention needs the model's ForwardContext as packed_seq_params")
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = to_thd(x)
        if ctx.cp is not None:
            x = gather_sequence(x, ctx.cp)
        out = self.mix(x, whole_sequences(ctx).to(x.device))
        if ctx.cp is not None:
            out = out.index_select(0, ctx.cp.local_index.to(out.device))
        out, _ = self.o_proj(from_thd(out, ctx.seq_len, ctx.batch))
        return out, None


def kda_weight_maps(arch, prefix: str, hf_prefix: str) -> list[WeightMap]:
    """Maps of one linear_attention layer's KDA: megatron names under `prefix` (the layer's `self_attention`), the
    checkpoint's on-disk names under `hf_prefix` (its `self_attn`)."""
    return [WeightMap(f"{prefix}.{name}", (f"{hf_prefix}.{name}",), kind) for name, kind in PARAMETERS]
