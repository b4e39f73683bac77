"""Architecture of the grouped-query-attention families (llama, qwen2, qwen3, qwen3_moe, glm4_moe), and
the config.json reading they share. Each family's `config.py` states only what differs (biases, QK-norm,
which layers are MoE, the router). No megatron import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_plugins.models.common.config import ArchConfig, UnsupportedModelError, rope_parameters_of


@dataclass(frozen=True)
class GqaConfig(ArchConfig):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    rope_parameters: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # q and k RMS-normed over all heads at once (MiniMax-M2) by the attention's own q_norm / k_norm, as upstream's
    # spec names them too (torch_dist keys stay `self_attention.q_norm`, not Megatron's per-head q_layernorm)
    full_width_qk_norm: bool = False
    rope_interleaved: bool = False  # GPT-J pairs (2i, 2i+1) instead of NeoX halves (GLM-4)
    # MoE (sparse layers)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    router: str = "softmax"  # "softmax" (Qwen-MoE) | "sigmoid" (GLM: expert bias, groups, scaling)
    router_dtype_float32: bool = False
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    mtp_num_layers: int = 0  # MTP layers in the checkpoint, kept unchanged (not trained)
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * float(self.rope_parameters.get("partial_rotary_factor", 1.0)))

    @property
    def kv_channels(self) -> int:
        return self.head_dim

    def validate(self) -> None:
        self.check_layer_types()
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                                        f"num_key_value_heads={self.num_key_value_heads}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise UnsupportedModelError(f"rotary dims {self.rotary_dim} (head_dim x partial_rotary_factor) must be even "
                                        f"and at most head_dim={self.head_dim}")
        if self.has_moe:
            if self.n_routed_experts <= 0 or not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise UnsupportedModelError(f"MoE layers need 0 < num_experts_per_tok={self.num_experts_per_tok} <= "
                                            f"number of experts={self.n_routed_experts}")
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise UnsupportedModelError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")


def check_supported(hf: dict[str, Any], model_type: str) -> None:
    """Options of these transformers classes that slime does not implement: one line each."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise UnsupportedModelError(f"{model_type}: sliding-window attention is not supported; set use_sliding_window=false")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{model_type}: mlp_bias=true is not supported")
    if int(hf.get("pretraining_tp") or 1) != 1:
        raise UnsupportedModelError(f"{model_type}: pretraining_tp={hf['pretraining_tp']} is not supported (1 only)")


def base_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every GQA family reads the same way."""
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return dict(
        model_type=hf["model_type"],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters_of(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_config=dict(hf),
    )


def dense_layers(hf: dict[str, Any]) -> tuple[str, ...]:
    return ("dense",) * int(hf["num_hidden_layers"])


def build(hf: dict[str, Any], **fields: Any) -> GqaConfig:
    """GqaConfig from the shared fields plus the family's `fields`, validated."""
    check_supported(hf, hf["model_type"])
    cfg = GqaConfig(**(base_fields(hf) | fields))
    cfg.validate()
    return cfg
