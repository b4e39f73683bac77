"""GLM-5.3-Flash's DSA layers (`indexed_attention`): multi-latent attention with no rotary part (NoPE) whose keys
are chosen by a lightning indexer over k-pool compressed keys (transformers' Glm5NextTextAttention and
Glm5NextTextIndexer).

The MLA is GLM-5's (slime_plugins/models/glm5/attention.py) with qk_rope_head_dim 0: q = q_b(rmsnorm(q_a(x))),
[k_nope | v] = kv_b(rmsnorm(kv_a(x))), no rotary at all (transformers passes no position embeddings; the ops'
rotary is never called with a zero width), scale qk_head_dim^-0.5, norms with the config's rms_norm_eps.
Attention sees only the keys the indexer selected (transformers builds the mask from the top-k alone; the
selection is causal by construction). An "indexed_attention" layer of indexer type "full" runs the indexer
(`ops.kpool_indexer`, under no_grad, frozen weights); a "shared" one reuses the selection of the DSA layer
right before it (transformers hands the top-k on only from a full layer to the next layer), through
ForwardContext.topk. Under --use-rollout-indexer-replay a full layer's rows are the rollout engine's selection
(ForwardContext.indexer_topk, slime/utils/indexer_replay.py) wherever the engine recorded one, so its shared
layers reuse that too. Queries that have no selected key (index_kpool_always_select_tail=False, the first
kpool - 1 positions of a sequence) get a zero output; transformers' eager attention has no defined value there
(a softmax over a fully masked row).

Parallelism as GLM-5's MLA: TP splits the heads (q_b / kv_b column-parallel, o_proj row-parallel; the
down-projections and the indexer replicated); sequence parallel gathers the sequence at the input and o_proj
reduce-scatters; context parallel all-gathers the compressed latent (with grad) and the indexer's keys and gate
scores (without) over the CP group, each local chunk attending over its sequence's prefix.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime.utils.indexer_replay import replayed
from slime_plugins.models.common.context_parallel import gather_sequence, key_rows
from slime_plugins.models.common.layers import (ReplicatedLinear, RMSNorm, column_parallel, from_thd, row_parallel,
                                                to_thd)
from slime_plugins.models.common.rope import ForwardContext
from slime_plugins.models.common.weights import REPLICATED, TP_COLS, TP_ROWS, WeightMap
from slime_plugins.models.glm5.attention import CoreAttention

__all__ = ["KpoolIndexer", "NopeMlaDsaAttention", "dsa_weight_maps", "topk_source_layer"]

INDEXER_NAMES = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
                 "index_kpool_compress_ape", "index_kpool_compress_gate")


def topk_source_layer(arch, layer: int) -> int:
    """The layer whose indexer selection DSA layer `layer` uses: itself when "full", else the full DSA layer
    before it (only DSA layers in between; transformers requires the one right before it)."""
    source = layer
    while arch.indexer_type(source) == "shared":
        source -= 1
        if source < 0 or arch.indexer_type(source) is None:
            raise ValueError(f"DSA layer {layer} has indexer type 'shared' but no full DSA layer precedes it without a "
                             "KDA layer in between; set indexer_types so a 'full' DSA layer comes first")
    return source


class KpoolIndexer(torch.nn.Module):
    """The k-pool lightning indexer (transformers' parameter names). Runs without grad (as in transformers); its
    weights are loaded and exported but frozen (requires_grad=False)."""

    def __init__(self, arch, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        heads, dim = arch.index_n_heads, arch.index_head_dim
        self.wq_b = ReplicatedLinear(arch.q_lora_rank, heads * dim, dtype=dtype)
        self.wk = ReplicatedLinear(arch.hidden_size, dim, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.weights_proj = ReplicatedLinear(arch.hidden_size, heads, dtype=dtype)
        # transformers' initial values (a checkpoint overwrites them)
        self.index_kpool_compress_ape = torch.nn.Parameter(torch.zeros(arch.index_kpool, dim, dtype=dtype))
        self.index_kpool_compress_gate = torch.nn.Parameter(torch.ones(dim, arch.hidden_size, dtype=dtype))
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, H] (this rank's tokens, the whole sequence without CP), q_resid [T, q_lora_rank] -> the selected
        key positions [T, index_topk (+ index_kpool - 1 with the tail)], -1 = none."""
        arch = self.arch
        dim = arch.index_head_dim
        q = self.wq_b(q_resid).view(-1, arch.index_n_heads, dim)
        k = F.layer_norm(self.wk(x), (dim,), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        gate = F.linear(x, self.index_kpool_compress_gate)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # transformers: .float() first
        weights = self.weights_proj(x).to(compute) * arch.index_n_heads ** -0.5
        if ctx.cp is not None:  # context parallel: keys and gate scores of the whole causal prefix (no grad)
            k, gate = key_rows(gather_sequence(torch.cat([k, gate], dim=-1), ctx.cp), ctx.cp).split([dim, dim], -1)
        return get_accelerator().ops.kpool_indexer(
            q, k, gate, self.index_kpool_compress_ape, weights, ctx.cu_seqlens, ctx.key_segments(), arch.index_topk,
            arch.index_kpool, arch.index_kpool_always_select_tail, softmax_scale=dim ** -0.5)


class NopeMlaDsaAttention(MegatronModule):
    """Megatron self-attention submodule of an indexed_attention layer: forward(hidden [S(/tp), B, H], ...,
    packed_seq_params=ForwardContext) -> (output [S(/tp), B, H], None)."""

    def __init__(self, config, layer_number: int, arch, **_: object) -> None:
        super().__init__(config=config)
        if arch.qk_rope_head_dim != 0 or arch.q_lora_rank is None:
            raise ValueError(f"NopeMlaDsaAttention needs qk_rope_head_dim 0 and a q_lora_rank, got "
                             f"{arch.qk_rope_head_dim} / {arch.q_lora_rank}")
        self.arch = arch
        self.layer_index = layer_number - 1  # megatron layer numbers are 1-based and global
        self.heads = arch.num_attention_heads // config.tensor_model_parallel_size
        dtype, bias, eps, heads = config.params_dtype, arch.attention_bias, arch.rms_norm_eps, arch.num_attention_heads
        self.q_a_proj = ReplicatedLinear(arch.hidden_size, arch.q_lora_rank, bias=bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(config, arch.q_lora_rank, eps=eps, sequence_parallel=False)
        self.q_b_proj = column_parallel(config, arch.q_lora_rank, heads * arch.qk_head_dim, sequence_parallel=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(arch.hidden_size, arch.kv_lora_rank, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(config, arch.kv_lora_rank, eps=eps, sequence_parallel=False)
        self.kv_b_proj = column_parallel(config, arch.kv_lora_rank, heads * (arch.qk_nope_head_dim + arch.v_head_dim),
                                         sequence_parallel=False)
        self.o_proj = row_parallel(config, heads * arch.v_head_dim, arch.hidden_size, bias=bias)
        self.core_attention = CoreAttention(arch)  # reads arch.softmax_scale = qk_head_dim^-0.5
        self.recompute_core_attention = (config.recompute_granularity == "selective"
                                         and "core_attn" in (config.recompute_modules or ()))
        self.topk_source = topk_source_layer(arch, self.layer_index)
        self.indexer = KpoolIndexer(arch, dtype) if self.topk_source == self.layer_index else None

    def may_drop_keys(self, ctx: ForwardContext) -> bool:
        """Whether the selection can leave out a causal key. A query at position p keeps min(index_topk /
        index_kpool, its complete pools) pools and, with always_select_tail, its incomplete pool: when no
        sequence is longer than index_topk + index_kpool - 1 (each lies within one row of ctx.seq_len tokens,
        packed or not) that is every causal key, so sparse attention over the selection is the dense causal
        attention and the layer skips the indexer and the selection mask. Not without the tail (the tail keys
        are dropped), nor under context parallel (the indexer's all-gather needs every CP rank)."""
        arch = self.arch
        return (ctx.cp is not None or not arch.index_kpool_always_select_tail
                or ctx.seq_len > arch.index_topk + arch.index_kpool - 1)

    def _selection(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """This layer's key selection (None: every causal key)."""
        if not self.may_drop_keys(ctx):
            return None
        if self.indexer is not None:
            topk = self.indexer(x, q_resid.detach(), ctx)
            if ctx.indexer_topk is not None and self.layer_index < self.arch.num_hidden_layers:  # MTP: its own
                topk = replayed(topk, ctx.indexer_topk, self.layer_index)  # --use-rollout-indexer-replay
            ctx.topk[self.layer_index] = topk
        topk = ctx.topk.get(self.topk_source)
        if topk is None:
            raise RuntimeError(f"DSA layer {self.layer_index} shares layer {self.topk_source}'s selection, which did not "
                               "run in this forward (pipeline stages must not split a full layer from its shared layers)")
        return topk

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("NopeMlaDsaAttention needs the model's ForwardContext as packed_seq_params")
        arch = self.arch
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = to_thd(x)  # [T, H]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q, _ = self.q_b_proj(q_resid)
        q = q.view(-1, self.heads, arch.qk_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        if ctx.cp is not None:  # the compressed keys of each local chunk's causal prefix, up-projected here
            latent = key_rows(gather_sequence(latent, ctx.cp), ctx.cp)
        kv, _ = self.kv_b_proj(latent)
        k, v = kv.view(-1, self.heads, arch.qk_nope_head_dim + arch.v_head_dim).split(
            [arch.qk_nope_head_dim, arch.v_head_dim], dim=-1)
        topk = self._selection(x, q_resid, ctx)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            out = tensor_parallel.checkpoint(functools.partial(self.core_attention, ctx=ctx), False, q, k, v, topk)
        else:
            out = self.core_attention(q, k, v, topk, ctx)
        out = from_thd(out.reshape(out.shape[0], -1), ctx.seq_len, ctx.batch)
        out, _ = self.o_proj(out)
        return out, None


def dsa_weight_maps(arch, layer: int, prefix: str, hf_prefix: str) -> list[WeightMap]:
    """Maps of one indexed_attention layer's attention: megatron names under `prefix` (the layer's
    `self_attention`), the checkpoint's under `hf_prefix` (its `self_attn`); the indexer on full layers only."""
    a, h = prefix, hf_prefix
    maps = [WeightMap(f"{a}.{name}", (f"{h}.{name}",), kind) for name, kind in (
        ("q_a_proj.weight", REPLICATED), ("q_a_layernorm.weight", REPLICATED), ("q_b_proj.weight", TP_ROWS),
        ("kv_a_proj_with_mqa.weight", REPLICATED), ("kv_a_layernorm.weight", REPLICATED),
        ("kv_b_proj.weight", TP_ROWS), ("o_proj.weight", TP_COLS))]
    if arch.attention_bias:  # transformers: q_b_proj and kv_b_proj never have one
        maps += [WeightMap(f"{a}.{name}", (f"{h}.{name}",), REPLICATED)
                 for name in ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias")]
    if topk_source_layer(arch, layer) == layer:
        maps += [WeightMap(f"{a}.indexer.{name}", (f"{h}.indexer.{name}",), REPLICATED) for name in INDEXER_NAMES]
    return maps
