"""Multi-latent attention (MLA) with the optional DSA indexer, from megatron's parallel linear layers.

TP: query/key/value heads are split over TP ranks (q_b / kv_b column-parallel, o_proj row-parallel); the
low-rank down-projections (q_a, kv_a) and the DSA indexer are replicated. With sequence parallel the
layer gathers the full sequence once at its input (backward: each rank keeps its slice of the - identical -
input grad) and o_proj reduce-scatters back to sequence-parallel. Context parallel: each rank's queries are its sequence chunks; the compressed keys (and
the DSA indexer keys) of the whole sequence are all-gathered over the CP group (common/context_parallel.py).
All math goes through
`get_accelerator().ops` (rms_norm, apply_rotary, attention / sparse_attention, lightning_indexer).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.accelerator import get_accelerator
from slime_plugins.models.common.context_parallel import gather_sequence, key_rows
from slime_plugins.models.common.layers import (KeepsFloat32, ReplicatedLinear, RMSNorm, column_parallel, from_thd,
                                                row_parallel, to_thd)
from slime_plugins.models.common import spec
from slime_plugins.models.common.rope import ForwardContext
from slime_plugins.models.glm5.config import GlmConfig


class DsaIndexer(KeepsFloat32, torch.nn.Module):
    """GLM-5's lightning indexer: picks each query's top-k keys. Runs without grad (as in transformers);
    its weights are loaded and exported but frozen (requires_grad=False)."""

    float32_names = ("weights_proj.weight",)

    def __init__(self, cfg: GlmConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype=dtype)
        self.wk = ReplicatedLinear(cfg.hidden_size, cfg.index_head_dim, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(cfg.index_head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, cfg.index_n_heads, dtype=torch.float32)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg, ops = self.cfg, get_accelerator().ops
        q = self.wq_b(q_resid).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        k = F.layer_norm(self.wk(x), (cfg.index_head_dim,), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        q = ops.apply_rotary(q, ctx.cos, ctx.sin, rotary_dim=cfg.qk_rope_head_dim, interleaved=True)
        k = ops.apply_rotary(k[:, None, :], ctx.cos, ctx.sin, rotary_dim=cfg.qk_rope_head_dim, interleaved=True)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * cfg.index_n_heads ** -0.5
        if ctx.cp is not None:  # context parallel: the keys of the whole causal prefix (no grad: frozen)
            k = key_rows(gather_sequence(k, ctx.cp), ctx.cp)
        return ops.lightning_indexer(q, k, weights, ctx.cu_seqlens, ctx.key_segments(), cfg.index_topk, causal=True,
                                     softmax_scale=cfg.index_head_dim ** -0.5)


class CoreAttention(torch.nn.Module):
    """softmax(q k^T) v over each sequence (dense, or DSA's top-k keys; topk=None: every causal key, also
    for DSA layers whose sequences are no longer than index_topk): no parameters, so selective
    recompute (`core_attn`) keeps only q, k, v and recomputes the scores in backward."""

    def __init__(self, glm: GlmConfig) -> None:
        super().__init__()
        self.glm = glm

    def forward(self, q, k, v, topk, ctx: ForwardContext) -> torch.Tensor:
        ops = get_accelerator().ops
        if topk is None:
            return ops.attention(q, k, v, ctx.cu_seqlens, ctx.key_segments(), causal=True,
                                 softmax_scale=self.glm.softmax_scale)
        return ops.sparse_attention(q, k, v, topk, ctx.cu_seqlens, ctx.key_segments(), causal=True,
                                    softmax_scale=self.glm.softmax_scale)


class MLASelfAttention(MegatronModule):
    """Megatron self-attention submodule: forward(hidden [S(/tp), B, H], ..., packed_seq_params=ForwardContext)
    -> (output [S(/tp), B, H], None)."""

    def __init__(self, config, layer_number: int, arch: GlmConfig, **_: object) -> None:
        super().__init__(config=config)
        glm = self.glm = arch
        self.layer_index = layer_number - 1  # megatron layer numbers are 1-based and global
        tp = config.tensor_model_parallel_size
        self.heads = glm.num_attention_heads // tp
        dtype, bias = config.params_dtype, glm.attention_bias
        qk = glm.qk_head_dim
        if glm.q_lora_rank is None:
            self.q_proj = column_parallel(config, glm.hidden_size, glm.num_attention_heads * qk, sequence_parallel=False)
        else:
            self.q_a_proj = ReplicatedLinear(glm.hidden_size, glm.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config, glm.q_lora_rank, eps=1e-6, sequence_parallel=False)
            self.q_b_proj = column_parallel(config, glm.q_lora_rank, glm.num_attention_heads * qk, sequence_parallel=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(glm.hidden_size, glm.kv_lora_rank + glm.qk_rope_head_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(config, glm.kv_lora_rank, eps=1e-6, sequence_parallel=False)
        self.kv_b_proj = column_parallel(config, glm.kv_lora_rank,
                                         glm.num_attention_heads * (glm.qk_nope_head_dim + glm.v_head_dim),
                                         sequence_parallel=False)
        self.o_proj = row_parallel(config, glm.num_attention_heads * glm.v_head_dim, glm.hidden_size, bias=bias)
        self.core_attention = CoreAttention(glm)
        self.recompute_core_attention = (config.recompute_granularity == "selective"
                                         and "core_attn" in (config.recompute_modules or ()))
        self.indexer = None
        self.topk_source = None  # DSA: index of the layer whose top-k this layer uses
        kind = glm.indexer_type(self.layer_index)
        if kind == "full":
            self.indexer = DsaIndexer(glm, dtype)
            self.topk_source = self.layer_index
        elif kind == "shared":
            self.topk_source = max(i for i in range(self.layer_index) if glm.indexer_type(i) == "full")

    def may_drop_keys(self, ctx: ForwardContext) -> bool:
        """Whether DSA's top-k can leave out a causal key. It keeps index_topk keys per query: when no
        sequence is longer than that (each lies within one row of ctx.seq_len tokens, packed or not), the
        indexer would select every causal key and sparse attention over them is the dense causal attention,
        so the layer skips both the indexer and the selection mask. Not under context parallel: the CP
        ranks' key rows differ, and the indexer's all-gather needs every rank."""
        return ctx.cp is not None or self.glm.index_topk < ctx.seq_len

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params: ForwardContext | None = None,
                **_: object):
        ctx = packed_seq_params
        if not isinstance(ctx, ForwardContext):
            raise TypeError("MLASelfAttention needs the model's ForwardContext as packed_seq_params (use the DecoderModel)")
        glm, ops = self.glm, get_accelerator().ops
        x = hidden_states
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = to_thd(x)  # [T, H]
        q_resid = None
        if glm.q_lora_rank is None:
            q, _ = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q, _ = self.q_b_proj(q_resid)
        q = q.view(-1, self.heads, glm.qk_head_dim)
        q_nope, q_rope = q.split([glm.qk_nope_head_dim, glm.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([glm.kv_lora_rank, glm.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.config.tensor_model_parallel_size > 1:
            # The shared rope key meets only this rank's heads: its grad is partial, summed over TP.
            k_rope = tensor_parallel.copy_to_tensor_model_parallel_region(k_rope)
        q_rope = ops.apply_rotary(q_rope, ctx.cos, ctx.sin, interleaved=glm.rope_interleave)
        k_rope = ops.apply_rotary(k_rope[:, None, :], ctx.cos, ctx.sin, interleaved=glm.rope_interleave)
        if ctx.cp is not None:
            # Context parallel: gather the compressed keys (kv_lora_rank + rope dims per token) of the whole
            # sequence, keep each local chunk's causal prefix, then up-project k/v here.
            compressed = torch.cat([latent, k_rope[:, 0, :]], dim=-1)
            compressed = key_rows(gather_sequence(compressed, ctx.cp), ctx.cp)
            latent, k_rope = compressed.split([glm.kv_lora_rank, glm.qk_rope_head_dim], dim=-1)
            k_rope = k_rope[:, None, :]
        kv, _ = self.kv_b_proj(latent)
        kv = kv.view(-1, self.heads, glm.qk_nope_head_dim + glm.v_head_dim)
        k_nope, v = kv.split([glm.qk_nope_head_dim, glm.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.heads, -1)], dim=-1)
        topk = None
        if self.topk_source is not None and self.may_drop_keys(ctx):
            if self.indexer is not None:
                ctx.topk[self.layer_index] = self.indexer(x, q_resid.detach(), ctx)
            topk = ctx.topk.get(self.topk_source)
            if topk is None:
                raise RuntimeError(f"DSA layer {self.layer_index} shares layer {self.topk_source}'s top-k, which did not "
                                   "run in this forward (pipeline stages must not split a full layer from its shared layers)")
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            out = tensor_parallel.checkpoint(functools.partial(self.core_attention, ctx=ctx), False, q, k, v, topk)
        else:
            out = self.core_attention(q, k, v, topk, ctx)
        out = from_thd(out.reshape(out.shape[0], -1), ctx.seq_len, ctx.batch)
        out, _ = self.o_proj(out)
        return out, None


def layer_spec(glm: GlmConfig, layer_index: int):
    """The GLM-5 decoder layer's megatron spec (MLA attention; the shared norms, MLP and MoE): the main decoder's
    and the MTP block's (slime_plugins.models.glm5.model, .mtp)."""
    return spec.layer_spec(glm, layer_index, MLASelfAttention)
