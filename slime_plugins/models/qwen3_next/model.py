"""The hybrid Qwen model (qwen3_next, Qwen3.5 dense / MoE) on the shared DecoderModel.

Each decoder layer's token mixer is the Gated DeltaNet (`linear_attention` layers) or gated attention
(`full_attention`): GQA with QK-norm and partial rotary whose q_proj also gives, per head, a gate g with
output = o_proj(attention * sigmoid(g)) (Megatron's --attention-output-gate). MoE layers add a shared
expert scaled by sigmoid(x . gate_weight) (Megatron's --moe-shared-expert-gate). All RMSNorms but the
DeltaNet's are zero-centred (config.layernorm_zero_centered_gamma).

Parallelism of the DeltaNet: its weights are whole on every TP rank (as upstream's, and as checkpoints store
them), its heads split over TP: under sequence parallel the layer gathers the TP ranks' tokens, under context
parallel the CP ranks' chunks too, runs its key heads (and their value heads) over whole sequences, keeps the CP
rank's rows and reduce-scatters the heads' partial outputs over TP. A rank's weight grads cover its heads' rows
only and are summed over TP (marked `sequence_parallel`), over CP by the data-parallel reduction as every other
weight's; the gathers' backward sums the input grads. Weight memory does not shrink with TP, and every CP rank
runs whole sequences (the recurrence is computed CP times).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime_plugins.models.common import model as common
from slime_plugins.models.common.context_parallel import gather_sequence, key_rows
from slime_plugins.models.common.gqa_attention import GQASelfAttention, _heads_projection
from slime_plugins.models.common.gqa_model import attention_maps
from slime_plugins.models.common.layers import ReplicatedLinear, SwiGLUMLP, from_thd, to_thd
from slime_plugins.models.common.moe import MoELayer
from slime_plugins.models.common.rope import ForwardContext
from slime_plugins.models.common.weights import (REPLICATED, TP_COLS, TP_GATE_UP, WeightMap, mlp_maps, model_maps,
                                                 stage_of)
from slime_plugins.models.qwen3_next import delta_rule


def _span(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)


class DeltaNetMixer(torch.nn.Module):
    """The Gated DeltaNet on whole packed sequences: x [T, H], sequence lengths -> this TP rank's part of the
    output [T, H] (summed over the TP ranks it is the layer's output). The weights are whole on every rank
    (transformers' names, `linear_attn.*`); rank r of tp computes key heads r * nk / tp .. and their value heads,
    reading its rows of the projections, convolution, dt_bias / A_log and its columns of out_proj."""

    def __init__(self, arch, dtype: torch.dtype, tp: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.arch = arch
        h, nv = arch.hidden_size, arch.linear_num_value_heads
        conv_dim = 2 * arch.key_dim + arch.value_dim
        self.tp, self.nk, self.nv = tp, arch.linear_num_key_heads // tp, nv // tp  # this rank's heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        keys, values = _span(rank * self.nk * dk, self.nk * dk), _span(rank * self.nv * dv, self.nv * dv)
        # this rank's channels of the [q | k | v] convolution input (and of Qwen3.5's in_proj_qkv rows)
        self.register_buffer("conv_channels", torch.cat([keys, keys + arch.key_dim, values + 2 * arch.key_dim]),
                             persistent=False)
        self.register_buffer("value_rows", values, persistent=False)  # in_proj_z rows, out_proj columns
        self.register_buffer("value_heads", _span(rank * self.nv, self.nv), persistent=False)
        per_key_head = 2 * dk + 2 * (nv // arch.linear_num_key_heads) * dv
        self.register_buffer("qkvz_rows", _span(rank * self.nk * per_key_head, self.nk * per_key_head), persistent=False)
        self.register_buffer("ba_rows", _span(rank * 2 * self.nv, 2 * self.nv), persistent=False)
        if arch.projections == "qkvz":  # qwen3_next: rows grouped per key head
            self.in_proj_qkvz = ReplicatedLinear(h, conv_dim + arch.value_dim, dtype=dtype)
            self.in_proj_ba = ReplicatedLinear(h, 2 * nv, dtype=dtype)
        else:  # Qwen3.5: [q | k | v] rows, z, b and a apart
            self.in_proj_qkv = ReplicatedLinear(h, conv_dim, dtype=dtype)
            self.in_proj_z = ReplicatedLinear(h, arch.value_dim, dtype=dtype)
            self.in_proj_b = ReplicatedLinear(h, nv, dtype=dtype)
            self.in_proj_a = ReplicatedLinear(h, nv, dtype=dtype)
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, arch.linear_conv_kernel_dim, groups=conv_dim, bias=False,
                                      dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(nv, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(nv, dtype=dtype).uniform_(0.01, 16).log())
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(arch.linear_value_head_dim, dtype=dtype))
        self.out_proj = ReplicatedLinear(arch.value_dim, h, dtype=dtype)

    def _rows(self, layer: ReplicatedLinear, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight if self.tp == 1 else layer.weight.index_select(0, rows))

    def _projections(self, x: torch.Tensor):
        """This rank's (q|k|v convolution input [T, channels], z [T, nv, dv], b [T, nv], a [T, nv])."""
        arch, t, nk, nv = self.arch, x.shape[0], self.nk, self.nv
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        if arch.projections != "qkvz":
            return (self._rows(self.in_proj_qkv, x, self.conv_channels),
                    self._rows(self.in_proj_z, x, self.value_rows).view(t, nv, dv),
                    self._rows(self.in_proj_b, x, self.value_heads), self._rows(self.in_proj_a, x, self.value_heads))
        per = nv // nk
        qkvz = self._rows(self.in_proj_qkvz, x, self.qkvz_rows).view(t, nk, -1)
        q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
        b, a = self._rows(self.in_proj_ba, x, self.ba_rows).view(t, nk, -1).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, nv, dv), b.reshape(t, nv), a.reshape(t, nv)

    def _local(self, param: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return param if self.tp == 1 else param.index_select(dim, index)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        arch, t, nk, nv = self.arch, x.shape[0], self.nk, self.nv
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        mixed, z, b, a = self._projections(x)
        beta = b.sigmoid()
        g = -self._local(self.A_log, self.value_heads).float().exp() * F.softplus(
            a.float() + self._local(self.dt_bias, self.value_heads))  # log-decay, float32
        conv_weight = self._local(self.conv1d.weight, self.conv_channels)
        mixed = delta_rule.causal_conv(delta_rule.to_padded(mixed, lengths), conv_weight)
        n, length = mixed.shape[:2]
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q, k = (y.reshape(n, length, nk, dk).repeat_interleave(nv // nk, dim=2) for y in (q, k))
        v = v.reshape(n, length, nv, dv)
        beta, g = delta_rule.to_padded(beta, lengths), delta_rule.to_padded(g, lengths)
        o = delta_rule.from_padded(delta_rule.gated_delta_rule(q, k, v, g, beta), lengths)  # [T, nv, dv]
        # gated RMSNorm: normalised in float32, weighted in the model dtype, times silu(z) in float32
        o = get_accelerator().ops.rms_norm(o, self.norm.weight, arch.rms_norm_eps)
        o = (o * F.silu(z.float())).to(x.dtype)
        return F.linear(o.reshape(t, -1), self._local(self.out_proj.weight, self.value_rows, dim=1))


class GatedDeltaNet(MegatronModule):
    """Megatron self-attention submodule of a linear_attention layer: the tokens of whole sequences in (TP and
    CP gathers), this rank's rows out."""

    def __init__(self, config, layer_number: int, arch, **_: object) -> None:
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
        self.linear_attn = DeltaNetMixer(arch, config.params_dtype, tp, rank)
        for p in self.linear_attn.parameters():  # grads of this TP rank's heads only: summed over TP
            p.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("GatedDeltaNet needs the model's ForwardContext as packed_seq_params (use the DecoderModel)")
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        x = to_thd(x)
        if ctx.cp is None:
            lengths = torch.diff(ctx.cu_seqlens).tolist()
        else:  # each rank holds 2 of a sequence's 2 * CP equal chunks, as consecutive query segments
            x = gather_sequence(x, ctx.cp)
            lengths = [n * 2 * ctx.cp.size for n in torch.diff(ctx.cp.cu_seqlens_q).tolist()[0::2]]
        y = self.linear_attn(x, lengths)
        if ctx.cp is not None:
            y = y.index_select(0, ctx.cp.local_index.to(y.device))
        y = from_thd(y, ctx.seq_len, ctx.batch)
        if self.config.tensor_model_parallel_size > 1:  # sum of the TP ranks' heads, this rank's sequence slice
            y = tensor_parallel.reduce_scatter_to_sequence_parallel_region(y.contiguous())
        return y.contiguous(), None


class GatedSelfAttention(GQASelfAttention):
    """GQA whose q_proj yields [query; gate] per head (HF layout); the attention output is multiplied by
    sigmoid(gate) before o_proj."""

    def __init__(self, config, layer_number: int, arch, **kwargs: object) -> None:
        super().__init__(config, layer_number, arch, **kwargs)
        self.q_proj = _heads_projection(config, arch.hidden_size, 2 * arch.num_attention_heads * arch.head_dim,
                                        arch.qkv_bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("GatedSelfAttention needs the model's ForwardContext as packed_seq_params")
        arch, ops, d = self.arch, get_accelerator().ops, self.arch.head_dim
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        x = to_thd(x)
        q, gate = self.q_proj(x)[0].view(-1, self.heads, 2 * d).split([d, d], dim=-1)
        k = self.k_proj(x)[0].view(-1, self.kv_heads, d)
        v = self.v_proj(x)[0].view(-1, self.kv_heads, d)
        q, k = self.q_norm(q), self.k_norm(k)
        q = ops.apply_rotary(q, ctx.cos, ctx.sin, rotary_dim=arch.rotary_dim, interleaved=arch.rope_interleaved)
        k = ops.apply_rotary(k, ctx.cos, ctx.sin, rotary_dim=arch.rotary_dim, interleaved=arch.rope_interleaved)
        if ctx.cp is not None:
            kv = key_rows(gather_sequence(torch.cat([k, v], dim=-1), ctx.cp), ctx.cp)
            k, v = kv.split([d, d], dim=-1)
        out = ops.attention(q, k, v, ctx.cu_seqlens, ctx.key_segments(), causal=True, softmax_scale=d ** -0.5)
        out = out.reshape(out.shape[0], -1) * torch.sigmoid(gate.reshape(gate.shape[0], -1))
        out, _ = self.o_proj(from_thd(out, ctx.seq_len, ctx.batch))
        return out, None


class GatedSharedExpert(SwiGLUMLP):
    """The shared expert scaled per token by sigmoid(x . gate_weight) (HF: shared_expert, shared_expert_gate)."""

    def __init__(self, config, ffn_hidden_size: int, **kwargs: object) -> None:
        super().__init__(config, ffn_hidden_size, **kwargs)
        self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.gate_weight, std=0.02)
        self.gate_weight.sequence_parallel = config.sequence_parallel  # sees this TP rank's tokens

    def forward(self, x: torch.Tensor, padding_mask=None):
        out, _ = super().forward(x, padding_mask)
        return torch.sigmoid(F.linear(x, self.gate_weight)) * out, None


class GatedSharedExpertMoE(MoELayer):
    """Softmax-routed experts plus the gated shared expert (arch.shared_expert_intermediate_size)."""

    def __init__(self, config, arch=None, **kwargs: object) -> None:
        super().__init__(config, arch, **kwargs)
        if self.arch.shared_expert_intermediate_size:
            self.shared_experts = GatedSharedExpert(config, self.arch.shared_expert_intermediate_size)


class HybridTokenMixer:
    """The layer spec's attention "class": builds layer `layer_number`'s (1-based, global) token mixer."""

    moe_mlp = GatedSharedExpertMoE  # read by common/spec.py

    def __new__(cls, config, layer_number: int, arch, **kwargs: object):
        mixer = GatedDeltaNet if arch.is_linear(layer_number - 1) else GatedSelfAttention
        return mixer(config, layer_number, arch, **kwargs)


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized)."""
    config_overrides.setdefault("layernorm_zero_centered_gamma", True)
    return common.build_model(arch, HybridTokenMixer, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              **config_overrides)


def _linear_attention_maps(arch, prefix: str, hf_prefix: str) -> list[WeightMap]:
    a, h = f"{prefix}.self_attention.linear_attn", f"{hf_prefix}.linear_attn"
    projections = ("in_proj_qkvz", "in_proj_ba") if arch.projections == "qkvz" else (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    names = [f"{p}.weight" for p in projections] + ["conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"]
    return [WeightMap(f"{a}.{n}", (f"{h}.{n}",), REPLICATED) for n in names]


def layer_maps(arch, layer: int, prefix: str, hf_prefix: str, ep_rank: int, ep: int) -> list[WeightMap]:
    maps = mlp_maps(arch, layer, prefix, hf_prefix, ep_rank, ep)
    if arch.mlp_type(layer) == "sparse" and arch.shared_expert_intermediate_size:
        s, hm = f"{prefix}.mlp.shared_experts", f"{hf_prefix}.mlp"
        maps += [WeightMap(f"{s}.linear_fc1.weight", (f"{hm}.shared_expert.gate_proj.weight",
                                                      f"{hm}.shared_expert.up_proj.weight"), TP_GATE_UP),
                 WeightMap(f"{s}.linear_fc2.weight", (f"{hm}.shared_expert.down_proj.weight",), TP_COLS),
                 WeightMap(f"{s}.gate_weight", (f"{hm}.shared_expert_gate.weight",), REPLICATED)]
    mixer = _linear_attention_maps(arch, prefix, hf_prefix) if arch.is_linear(layer) else attention_maps(arch, prefix, hf_prefix)
    return maps[:2] + mixer + maps[2:]  # norms, token mixer, MLP


def _hf_prefixed(arch, maps: list[WeightMap]) -> list[WeightMap]:
    """Vision-language checkpoints (Qwen3.5) keep the text model under `model.language_model.`."""
    if arch.hf_prefix == "model":
        return maps
    import dataclasses

    def rename(name: str) -> str:
        return arch.hf_prefix + name[len("model"):] if name.startswith("model.") else name

    return [dataclasses.replace(m, hf=tuple(rename(n) for n in m.hf), expert_prefix=rename(m.expert_prefix)) for m in maps]


def hf_names(arch) -> list[str]:
    return [n for m in _hf_prefixed(arch, model_maps(arch, layer_maps, 0, arch.num_hidden_layers, True, True))
            for n in m.hf]


def maps_for_model(model) -> list[WeightMap]:
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    return _hf_prefixed(model.arch, model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep))
