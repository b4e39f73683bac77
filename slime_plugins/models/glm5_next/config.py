"""GLM-5.3-Flash (`glm5_next`, text-only `glm5_next_text`) architecture from an HF config.json.

Field names are transformers' `Glm5NextTextConfig` attributes. The multimodal checkpoint (`glm5_next`) keeps the
text fields under `text_config` and the vision tower's under `vision_config`, its tensors under
`model.language_model.` (text) and `model.visual.` (vision, kept unchanged); a flat `glm5_next_text` checkpoint
has the text fields at the top level and its tensors under `model.`. Defaults are transformers' (= the
published checkpoint's), including its rules for `layer_types`, `mlp_layer_types` and `indexer_types` when a
config omits them. No megatron import (command-line checks parse configs before Ray starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_plugins.models.common.config import ArchConfig, UnsupportedModelError

__all__ = ["Glm5NextConfig", "LINEAR", "INDEXED", "SUPPORTED_MODEL_TYPES", "from_hf"]

SUPPORTED_MODEL_TYPES = ("glm5_next", "glm5_next_text")
LINEAR, INDEXED = "linear_attention", "indexed_attention"  # KDA / DSA (NoPE MLA + k-pool indexer) layers


@dataclass(frozen=True)
class Glm5NextConfig(ArchConfig):
    model_type: str
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288  # dense MLP layers
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    layer_types: tuple[str, ...] = ()  # LINEAR | INDEXED per layer
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer
    indexer_types: tuple[str, ...] = ()  # "full" | "shared" per layer (read on INDEXED layers only)
    # KDA (linear_attention layers)
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0  # None: softplus decay (transformers' unsafe gate)
    # NoPE MLA (indexed_attention layers)
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    # lightning indexer with k-pool compression
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # mHC hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # MLPs: SwiGLU with gate <= limit, -limit <= up <= limit (experts, shared expert, dense layers)
    swiglu_limit: float | None = 10.0
    # MoE (sigmoid router with e_score_correction_bias, as GLM-5)
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    mtp_num_layers: int = 0  # HF num_nextn_predict_layers (layers stored after the decoder, `layers.{N}.`)
    hf_prefix: str = "model"  # "model.language_model" for the multimodal checkpoint
    kept_hf_prefixes: tuple[str, ...] = ()  # checkpoint tensors kept unchanged (the vision tower, MTP layers)
    vision_config: dict = field(default_factory=dict, compare=False, repr=False)  # {} for text-only
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # the config.json, for export

    router = "sigmoid"  # GLM/DeepSeek noaux_tc router, float32 as in transformers
    router_dtype_float32 = True
    rope_parameters = {"rope_type": "default"}  # NoPE: no rotary part anywhere (RotaryTable of width 0)
    rotary_dim = 0

    @property
    def multimodal(self) -> bool:
        return self.model_type == "glm5_next"

    @property
    def vision_hf_prefixes(self) -> tuple[str, ...]:
        """The vision tower's tensors: kept unchanged, never trained nor stored in a torch_dist checkpoint."""
        return ("model.visual.",) if self.multimodal else ()

    @property
    def num_key_value_heads(self) -> int:  # MLA: every head has its own key and value
        return self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_channels(self) -> int:
        return self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def linear_dim(self) -> int:
        """Width of KDA's q, k and v (heads x head_dim)."""
        return self.linear_num_heads * self.linear_head_dim

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a KDA layer (else DSA)."""
        return self.layer_types[layer] == LINEAR

    def indexer_type(self, layer: int) -> str | None:
        """"full" | "shared" of a DSA layer (None for KDA layers). A shared layer reuses the previous full
        layer's top-k; MTP layers (index >= num_hidden_layers) run their own indexer."""
        if layer >= self.num_hidden_layers:
            return "full"
        return None if self.is_linear(layer) else self.indexer_types[layer]

    def check_parallel(self, tp: int, ep: int) -> None:
        super().check_parallel(tp, ep)
        problems = [f"{name}={size} % tp={tp}" for name, size in (
            ("linear_num_heads", self.linear_num_heads if LINEAR in self.layer_types else 0),
            ("index_n_heads", self.index_n_heads if INDEXED in self.layer_types else 0)) if size % tp]
        if problems:
            raise ValueError("model does not split over the requested parallel sizes: " + "; ".join(problems)
                             + " (must be 0)")

    def validate(self) -> None:
        self.check_layer_types()
        n = self.num_hidden_layers
        if len(self.layer_types) != n or set(self.layer_types) - {LINEAR, INDEXED}:
            raise UnsupportedModelError(f"{self.model_type}: layer_types must list {LINEAR!r} / {INDEXED!r} for each "
                                        f"of {n} layers")
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            raise UnsupportedModelError(f"{self.model_type}: indexer_types must list 'full' / 'shared' for each of "
                                        f"{n} layers")
        first_dsa = next((i for i in range(n) if not self.is_linear(i)), None)
        if first_dsa is not None and self.indexer_types[first_dsa] != "full":
            raise UnsupportedModelError(f"{self.model_type}: the first DSA layer ({first_dsa}) must have indexer type "
                                        "'full' (a shared layer reuses an earlier full layer's top-k)")
        orphan = [i for i in range(n) if not self.is_linear(i) and self.indexer_types[i] == "shared"
                  and (i == 0 or self.is_linear(i - 1))]
        if orphan:  # transformers hands the top-k only from one DSA layer to the next
            raise UnsupportedModelError(f"{self.model_type}: shared DSA layers {orphan} do not follow a DSA layer "
                                        "(a shared layer reuses the top-k of the DSA layer right before it)")
        if self.qk_rope_head_dim != 0:
            raise UnsupportedModelError(f"{self.model_type}: qk_rope_head_dim={self.qk_rope_head_dim}; GLM-5.3-Flash's "
                                        "DSA layers are NoPE (0)")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise UnsupportedModelError(f"{self.model_type}: index_topk={self.index_topk} must be a multiple of "
                                        f"index_kpool={self.index_kpool} (>= 1)")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise UnsupportedModelError(f"{self.model_type}: hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise UnsupportedModelError(f"{self.model_type}: n_group={self.n_group} must divide "
                                        f"n_routed_experts={self.n_routed_experts}")
        if self.tie_word_embeddings:
            raise UnsupportedModelError(f"{self.model_type}: tie_word_embeddings=True is not supported "
                                        "(GLM-5.3-Flash checkpoints are untied)")


def _default_layer_types(n: int) -> list[str]:
    return [INDEXED if i % 4 == 3 else LINEAR for i in range(n)]  # transformers' rule


def _default_indexer_types(text: dict[str, Any], n: int) -> list[str]:
    """transformers' rule: `index_topk_pattern` ("F"/"S" per layer), else index_topk_freq / index_skip_topk_offset."""
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(text.get("index_topk_freq", 1)), 1), int(text.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _linear_attention_fields(text: dict[str, Any]) -> dict[str, Any]:
    """KDA fields, from the flat keys or the Kimi-style `linear_attn_config` dict (which wins, as in transformers)."""
    out = {k: text[k] for k in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound")
           if k in text}
    nested = text.get("linear_attn_config")
    if nested:
        for key, name in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                          ("short_conv_kernel_size", "linear_conv_kernel_dim"), ("gate_lower_bound", "linear_lower_bound")):
            if key in nested:
                out[name] = nested[key]
        if nested.get("safe_gate", True) and out.get("linear_lower_bound", -5.0) is None:
            out["linear_lower_bound"] = -5.0
    return out


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
               "index_head_dim", "index_topk", "index_kpool", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group")
_FLOAT_FIELDS = ("hc_eps", "routed_scaling_factor", "rms_norm_eps")
_BOOL_FIELDS = ("index_kpool_always_select_tail", "norm_topk_prob", "attention_bias")


def from_hf(hf: dict[str, Any]) -> Glm5NextConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not served by the glm5_next family; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    multimodal = model_type == "glm5_next"
    # transformers' Glm5NextConfig forwards the top-level fields as the text config when text_config is absent
    text = dict(hf["text_config"]) if multimodal and hf.get("text_config") is not None else dict(hf)
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act {text['hidden_act']!r} is not supported (only silu)")
    n = int(text.get("num_hidden_layers", Glm5NextConfig.num_hidden_layers))
    layer_types = ["indexed_attention" if t == "full_attention" else t
                   for t in (text.get("layer_types") or _default_layer_types(n))]
    mlp_types = text.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    kwargs: dict[str, Any] = {k: int(text[k]) for k in _INT_FIELDS if text.get(k) is not None}
    kwargs |= {k: float(text[k]) for k in _FLOAT_FIELDS if text.get(k) is not None}
    kwargs |= {k: bool(text[k]) for k in _BOOL_FIELDS if k in text}
    kwargs |= _linear_attention_fields(text)
    if "swiglu_limit" in text:
        kwargs["swiglu_limit"] = None if text["swiglu_limit"] is None else float(text["swiglu_limit"])
    if "pad_token_id" in text:
        kwargs["pad_token_id"] = text["pad_token_id"]
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    mtp = int(text.get("num_nextn_predict_layers") or 0)
    prefix = "model.language_model" if multimodal else "model"
    # MTP layers are stored as decoder layers past the last one; until they are trained they are kept unchanged
    kept = tuple(f"{prefix}.layers.{n + i}." for i in range(mtp)) + (("model.visual.",) if multimodal else ())
    cfg = Glm5NextConfig(
        model_type=model_type, num_hidden_layers=n, layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
        indexer_types=tuple(text.get("indexer_types") or _default_indexer_types(text, n)),
        tie_word_embeddings=bool(tie), mtp_num_layers=mtp, hf_prefix=prefix, kept_hf_prefixes=kept,
        vision_config=dict(hf.get("vision_config") or {}) if multimodal else {}, hf_config=dict(hf), **kwargs)
    cfg.validate()
    return cfg
