"""GLM-5-family architecture from an HF config.json, and the megatron TransformerConfig built from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slime_plugins.models.common.config import ArchConfig, UnsupportedModelError, rope_parameters_of

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "glm4_moe_lite")
__all__ = ["GlmConfig", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError"]


@dataclass(frozen=True)
class GlmConfig(ArchConfig):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense (first_k_dense_replace) layers
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    rms_norm_eps: float
    rope_parameters: dict = field(default_factory=dict)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # DSA (glm_moe_dsa only)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_types: tuple[str, ...] = ()  # "full" | "shared" per layer; empty = no DSA
    mtp_num_layers: int = 0  # HF num_nextn_predict_layers
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # the config.json, for export

    router = "sigmoid"  # GLM/DeepSeek noaux_tc router, float32 as in transformers
    router_dtype_float32 = True
    # What this reader accepts; a subclass (deepseek_v3/) serves other model_types with the same blocks.
    served_model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    reader_name: ClassVar[str] = "GLM-5"
    default_first_k_dense: ClassVar[int] = 1  # first_k_dense_replace when config.json omits it

    @property
    def transformers_model_type(self) -> str:
        """The transformers model_type whose config class reads this checkpoint (rotary tables)."""
        return self.model_type

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:  # MLA: every head has its own key and value
        return self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.v_head_dim

    @property
    def use_dsa(self) -> bool:
        return bool(self.indexer_types)

    def indexer_type(self, layer: int) -> str | None:
        """DSA "full" | "shared" of layer `layer` (None without DSA); MTP layers run their own indexer."""
        if not self.use_dsa:
            return None
        return self.indexer_types[layer] if layer < self.num_hidden_layers else "full"

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn's mscale^2 when the rope type scales attention (transformers' rule)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_type != "default" and self.rope_parameters.get("mscale_all_dim"):
            factor = float(self.rope_parameters["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * float(self.rope_parameters["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "GlmConfig":
        model_type = hf.get("model_type")
        if model_type not in cls.served_model_types:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the {cls.reader_name} Megatron backend; "
                f"supported: {', '.join(cls.served_model_types)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModelError("only the sigmoid + expert-bias (noaux_tc) router is supported")
        n = int(hf["num_hidden_layers"])
        k_dense = int(hf.get("first_k_dense_replace", cls.default_first_k_dense))
        mlp_types = tuple(hf.get("mlp_layer_types") or (["dense"] * min(k_dense, n) + ["sparse"] * max(n - k_dense, 0)))
        rope = rope_parameters_of(hf)
        dsa = model_type == "glm_moe_dsa"
        indexer_types = tuple(hf.get("indexer_types") or (["full"] * n)) if dsa else ()
        if dsa and indexer_types and indexer_types[0] != "full":
            raise UnsupportedModelError("indexer_types[0] must be 'full' (a shared layer reuses an earlier layer's top-k)")
        cfg = cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(hf["num_attention_heads"]),
            q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            n_routed_experts=int(hf["n_routed_experts"]),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            mlp_layer_types=mlp_types,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            rope_interleave=True if dsa else bool(hf.get("rope_interleave", True)),
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            index_n_heads=int(hf.get("index_n_heads", 0)) if dsa else 0,
            index_head_dim=int(hf.get("index_head_dim", 0)) if dsa else 0,
            index_topk=int(hf.get("index_topk", 0)) if dsa else 0,
            indexer_types=indexer_types,
            mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0),
            hf_config=dict(hf),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self.check_layer_types()
        if self.use_dsa and (len(self.indexer_types) != self.num_hidden_layers or set(self.indexer_types) - {"full", "shared"}):
            raise UnsupportedModelError(f"indexer_types must list 'full'/'shared' for each of {self.num_hidden_layers} layers")
        if self.use_dsa and (self.q_lora_rank is None or self.index_topk <= 0 or self.index_head_dim < self.qk_rope_head_dim):
            raise UnsupportedModelError("DSA needs q_lora_rank, index_topk > 0 and index_head_dim >= qk_rope_head_dim")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise UnsupportedModelError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if self.tie_word_embeddings:
            raise UnsupportedModelError("tie_word_embeddings=True is not supported (GLM-5-family checkpoints are untied)")
