"""Multi-token prediction (MTP) layers, DeepSeek-V3 / GLM style, stored in HF checkpoints as extra
decoder layers `model.layers.{N + k}` (N = num_hidden_layers) with enorm, hnorm, eh_proj, shared_head.

Depth k (1-based) predicts token t + k + 1 at position t:
    h_k = Layer_k(eh_proj(cat(enorm(embed(token[t + k])), hnorm(h_{k-1}[t]))))
    logits_k = output_layer(shared_head.norm(h_k))
Another family reuses the block with its own decoder layer by subclassing MtpBlock (`layer_spec_of`: MiMo,
slime_plugins/models/mimo/).
with h_0 the main decoder's output (after its final norm). The embedding and output layer are the main
model's (the checkpoint's per-layer `embed_tokens` / `shared_head.head` copies must equal them; export
writes the main ones back under those names). Under pipeline parallel the block is on the last stage, which
keeps a copy of the embedding (common/model.py).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from slime_plugins.models.common.layers import ReplicatedLinear, RMSNorm
from slime_plugins.models.glm5.config import GlmConfig
from slime_plugins.models.glm5.attention import layer_spec
from slime_plugins.models.glm5.weights import mtp_maps  # noqa: F401 (also this module's API)


def shift_within_sequences(input_ids: torch.Tensor, k: int, cu_seqlens: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """[B, S] ids -> ids k positions ahead inside each sequence (THD segments / rows), pad_id past the end."""
    batch, seq = input_ids.shape
    flat = input_ids.reshape(-1)
    t = torch.arange(flat.numel(), device=flat.device)
    seg = torch.searchsorted(cu_seqlens.to(t.device).long(), t, right=True) - 1
    end = cu_seqlens.to(t.device).long()[seg + 1]
    ahead = t + k
    valid = ahead < end
    return torch.where(valid, flat[ahead.clamp(max=flat.numel() - 1)], pad_id).view(batch, seq)


class MtpLayer(MegatronModule):
    def __init__(self, config, glm: GlmConfig, depth: int, layer_spec_of=layer_spec) -> None:
        super().__init__(config=config)
        self.depth = depth
        h = glm.hidden_size
        self.enorm = RMSNorm(config, h, eps=glm.rms_norm_eps)
        self.hnorm = RMSNorm(config, h, eps=glm.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype=config.params_dtype)
        # Sequence parallel: each TP rank projects its own tokens, so the weight's grad is summed over TP.
        self.eh_proj.weight.sequence_parallel = config.sequence_parallel
        self.transformer_layer = build_module(layer_spec_of(glm, glm.num_hidden_layers + depth - 1), config=config,
                                  layer_number=glm.num_hidden_layers + depth)
        self.final_layernorm = RMSNorm(config, h, eps=glm.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

        def run(h):
            return self.transformer_layer(hidden_states=h, attention_mask=None, packed_seq_params=ctx)[0]

        if self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(run, False, x)  # RNG states saved and restored by megatron
        return run(x)


class MtpBlock(MegatronModule):
    layer_spec_of = staticmethod(layer_spec)  # (arch, global layer index) -> the MTP layer's decoder-layer spec

    def __init__(self, config, glm: GlmConfig) -> None:
        super().__init__(config=config)
        self.layers = torch.nn.ModuleList(MtpLayer(config, glm, d + 1, self.layer_spec_of)
                                          for d in range(glm.mtp_num_layers))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each layer's own view: megatron's default treats the plain ModuleList as replicated tensors of the
        local shape, which under TP would store one rank's slice of the TP-split weights as the whole."""
        out = {}
        for i, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{i}.", sharded_offsets, metadata))
        return out

    def forward(self, model, input_ids, hidden, ctx, shifted_ids=None) -> list[torch.Tensor]:
        """Logits [S(/tp), B, V/tp] of each depth (before the TP gather), from the main hidden states.
        `shifted_ids[k - 1]`: depth k's input ids when the caller has them (context parallel: a local chunk's
        ids k ahead are in the next chunk, held by another rank); else shifted here within each sequence."""
        outputs = []
        for layer in self.layers:
            if shifted_ids is not None:
                ids = shifted_ids[layer.depth - 1].to(input_ids.device)
            else:
                ids = shift_within_sequences(input_ids, layer.depth, ctx.cu_seqlens)
            embedded = model.embedding(ids).transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                embedded = tensor_parallel.scatter_to_sequence_parallel_region(embedded)
            hidden = layer(hidden, embedded, ctx)
            logits = model.output_logits(layer.final_layernorm(hidden))
            outputs.append(logits)
        return outputs


def mtp_hf_names(glm: GlmConfig) -> list[str]:
    return [n for m in mtp_maps(glm, 0, 1) for n in m.hf]


def mtp_alias_names(glm: GlmConfig) -> dict[str, str]:
    """HF MTP tensors that are copies of main-model tensors: name -> main HF name."""
    out = {}
    for d in range(glm.mtp_num_layers):
        hp = f"model.layers.{glm.num_hidden_layers + d}"
        out[f"{hp}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{hp}.shared_head.head.weight"] = "lm_head.weight"
    return out
