"""Rotary angles (the first `arch.rotary_dim` features of each head: MLA's rope slice, or a GQA head's
rotary part), and the per-forward context handed to every attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from slime_plugins.models.common.context_parallel import ContextParallelLayout


def inv_freq_and_scaling(cfg) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rope dims = cfg.rotary_dim) and the cos/sin scaling of the checkpoint's
    rope type. "default" is computed here; other types (yarn, llama3, ...) use transformers' rope
    initializers on the checkpoint's config (which derive the rotary dims the same way)."""
    dim = cfg.rotary_dim
    if cfg.rope_type == "default":
        theta = float(cfg.rope_parameters.get("rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {cfg.rope_type!r} is unknown to transformers; supported: {sorted(ROPE_INIT_FUNCTIONS)}")
    hf = {k: v for k, v in cfg.hf_config.items() if k != "model_type"}
    # A checkpoint type transformers lacks (kimi_k2) is read by the config class of the one it ships.
    hf_config = AutoConfig.for_model(getattr(cfg, "transformers_model_type", cfg.model_type), **hf)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


@dataclass
class ForwardContext(PackedSeqParams):
    """What every attention layer of one forward shares: rotary cos/sin per token (THD order,
    [T, rope_dim // 2]), the sequence boundaries, and the DSA top-k of each "full" indexer layer (read by
    later "shared" layers). It travels through megatron's TransformerBlock as `packed_seq_params`, which
    the block hands to every layer without inspecting it, also under activation recompute (a closure,
    where `rotary_pos_emb` would have to be a tensor). Under context parallel the tokens are this CP rank's
    chunks (cos/sin of their global positions), cu_seqlens are the chunks' query segments and `cp` holds the
    key segments (slime_plugins/models/common/context_parallel.py)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # int32 [n + 1], leading 0
    batch: int = 0
    seq_len: int = 0
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    cp: ContextParallelLayout | None = None
    # --use-rollout-indexer-replay: the engine's DSA selections of these tokens, (positions int32 [T, layers, width],
    # replayed bool [T]) (slime.utils.indexer_replay); full DSA layers use them in place of their own
    indexer_topk: tuple[torch.Tensor, torch.Tensor] | None = None

    def key_segments(self) -> torch.Tensor:
        """cu_seqlens of the keys each query segment attends over (its own tokens without CP)."""
        return self.cu_seqlens if self.cp is None else self.cp.cu_seqlens_kv


@dataclass
class ContextParallelSeqParams(PackedSeqParams):
    """PackedSeqParams of one CP rank's share of a pack: cu_seqlens_q = cu_seqlens_kv = its query segments
    (one per local chunk); `context_parallel` the layout its attention layers gather keys with."""

    context_parallel: ContextParallelLayout | None = None


class RotaryTable(torch.nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        inv_freq, self.scaling = inv_freq_and_scaling(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> cos, sin [B*S, rope_dim // 2] in batch-major (THD) order."""
        freqs = position_ids.reshape(-1, 1).float() * self.inv_freq.to(position_ids.device)[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
