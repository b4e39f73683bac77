"""GLM-5-family architecture from an HF config.json, and the megatron TransformerConfig built from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "glm4_moe_lite")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is outside the GLM-5 family this backend implements."""


@dataclass(frozen=True)
class GlmConfig:
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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def use_dsa(self) -> bool:
        return bool(self.indexer_types)

    def mlp_type(self, layer: int) -> str:
        """"dense" | "sparse" of decoder layer `layer`; MTP layers (index >= num_hidden_layers) are MoE."""
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else "sparse"

    def indexer_type(self, layer: int) -> str | None:
        """DSA "full" | "shared" of layer `layer` (None without DSA); MTP layers run their own indexer."""
        if not self.use_dsa:
            return None
        return self.indexer_types[layer] if layer < self.num_hidden_layers else "full"

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the GLM-5 Megatron backend; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (GLM uses silu)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModelError("only the sigmoid + expert-bias (noaux_tc) router is supported")
        n = int(hf["num_hidden_layers"])
        k_dense = int(hf.get("first_k_dense_replace", 1))
        mlp_types = tuple(hf.get("mlp_layer_types") or (["dense"] * min(k_dense, n) + ["sparse"] * max(n - k_dense, 0)))
        rope = dict(hf.get("rope_parameters") or {})
        if not rope:  # older configs keep rope_theta / rope_scaling at top level
            rope = dict(hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", 10000.0)}
        rope.setdefault("rope_type", rope.pop("type", "default"))
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
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise UnsupportedModelError(f"mlp_layer_types must list 'dense'/'sparse' for each of {self.num_hidden_layers} layers")
        if self.use_dsa and (len(self.indexer_types) != self.num_hidden_layers or set(self.indexer_types) - {"full", "shared"}):
            raise UnsupportedModelError(f"indexer_types must list 'full'/'shared' for each of {self.num_hidden_layers} layers")
        if self.use_dsa and (self.q_lora_rank is None or self.index_topk <= 0 or self.index_head_dim < self.qk_rope_head_dim):
            raise UnsupportedModelError("DSA needs q_lora_rank, index_topk > 0 and index_head_dim >= qk_rope_head_dim")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise UnsupportedModelError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if self.tie_word_embeddings:
            raise UnsupportedModelError("tie_word_embeddings=True is not supported (GLM-5-family checkpoints are untied)")

    def check_parallel(self, tp: int, ep: int) -> None:
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads} % tp={tp}")
        if self.vocab_size % tp:
            problems.append(f"vocab_size={self.vocab_size} % tp={tp}")
        if self.n_routed_experts % ep:
            problems.append(f"n_routed_experts={self.n_routed_experts} % ep={ep}")
        for name, size in (("intermediate_size", self.intermediate_size),
                           ("moe_intermediate_size * n_shared_experts", self.moe_intermediate_size * self.n_shared_experts)):
            if size % tp:
                problems.append(f"{name}={size} % tp={tp}")
        if problems:
            raise ValueError("model does not split over the requested parallel sizes: " + "; ".join(problems) + " (must be 0)")

    def transformer_config(self, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                           perform_initialization: bool = False, **overrides: Any):
        """megatron TransformerConfig for this model. Sequence parallel is on whenever tp > 1 (the MoE
        layers see each TP rank's own tokens, as megatron requires for MoE with TP), so every forward's
        sequence length (packed T) must be a multiple of tp."""
        from megatron.core.transformer import TransformerConfig

        kwargs = dict(
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.intermediate_size,
            kv_channels=self.v_head_dim,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            num_moe_experts=self.n_routed_experts,  # megatron checks it for expert parallel; our MoE layer reads GlmConfig
            moe_router_topk=self.num_experts_per_tok,
            moe_ffn_hidden_size=self.moe_intermediate_size,
            sequence_parallel=tp > 1,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            layernorm_epsilon=self.rms_norm_eps,
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            perform_initialization=perform_initialization,
            init_method_std=0.02,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
        )
        n = self.num_hidden_layers
        if pp > 1 and n % pp:  # uneven split: the last stage takes the remainder
            base = n // pp
            if base == 0:
                raise ValueError(f"pp={pp} exceeds the {n} decoder layers")
            kwargs.update(num_layers_in_first_pipeline_stage=base, num_layers_in_last_pipeline_stage=n - base * (pp - 1))
        if tp > 1 and overrides.get("sequence_parallel", True) is False:
            raise ValueError("tp > 1 needs sequence parallel with the GLM MoE layers (expert grads are summed over "
                             "TP ranks); drop sequence_parallel=False and pad sequences to a multiple of tp")
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)
