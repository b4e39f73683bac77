"""Hybrid Qwen architectures (qwen3_next; Qwen3.5 dense and MoE) -> `HybridConfig`.

Every layer is "linear_attention" (Gated DeltaNet) or "full_attention" (GQA whose q_proj also yields a
per-head sigmoid output gate, QK RMSNorm, partial rotary); `layer_types` from config.json, else every
`full_attention_interval`-th layer is full attention (transformers' rule). All RMSNorms outside the
DeltaNet are zero-centred (`weight + 1`, Megatron's --apply-layernorm-1p); the DeltaNet's output norm is
a plain RMSNorm gated by silu(z). MoE layers route softmax top-k and add a shared expert scaled by
sigmoid(x . shared_expert_gate). Qwen3.5 checkpoints published as vision-language models keep the text
model under `text_config` and its tensors under `model.language_model.`; the vision tower and MTP layers
are kept unchanged (not trained). No megatron import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_plugins.models.common.gqa_config import GqaConfig, base_fields, check_supported
from slime_plugins.models.registry import UnsupportedModelError

LINEAR, FULL = "linear_attention", "full_attention"
# how each served model_type names its DeltaNet input projections
PROJECTIONS = {"qwen3_next": "qkvz", "qwen3_5": "qkv_z_b_a", "qwen3_5_text": "qkv_z_b_a",
               "qwen3_5_moe": "qkv_z_b_a", "qwen3_5_moe_text": "qkv_z_b_a"}


@dataclass(frozen=True)
class HybridConfig(GqaConfig):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    projections: str = "qkvz"  # "qkvz" (qwen3_next: in_proj_qkvz + in_proj_ba) | "qkv_z_b_a" (Qwen3.5)
    shared_expert_intermediate_size: int = 0  # gated shared expert of the MoE layers (0: none)
    hf_prefix: str = "model"  # "model.language_model" for the vision-language checkpoints
    kept_hf_prefixes: tuple[str, ...] = ("mtp.",)  # checkpoint tensors kept unchanged (MTP, vision tower)
    attention_output_gate = True  # q_proj yields [query; gate] per head (read by the torch_dist key translation)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def check_parallel(self, tp: int, ep: int) -> None:
        super().check_parallel(tp, ep)
        problems = [f"{name}={size} % tp={tp}" for name, size in (
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size if self.has_moe else 0),
            ("linear_num_key_heads", self.linear_num_key_heads if LINEAR in self.layer_types else 0)) if size % tp]
        if problems:
            raise ValueError("model does not split over the requested parallel sizes: " + "; ".join(problems)
                             + " (must be 0)")

    def validate(self) -> None:
        super().validate()
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise UnsupportedModelError(f"{self.model_type}: layer_types must list {LINEAR!r} / {FULL!r} for each of "
                                        f"{self.num_hidden_layers} layers")
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        if LINEAR in self.layer_types and (nk <= 0 or nv % nk or self.linear_key_head_dim <= 0
                                           or self.linear_value_head_dim <= 0):
            raise UnsupportedModelError(f"{self.model_type}: linear_num_value_heads={nv} must be a multiple of "
                                        f"linear_num_key_heads={nk} (both > 0, head dims > 0)")


def text_config(hf: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the text model's config dict, whether the checkpoint is the vision-language wrapper)."""
    if "text_config" not in hf:
        return dict(hf), False
    text = dict(hf["text_config"])
    if "tie_word_embeddings" in hf:  # the wrapper's setting is the one transformers applies
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text | {"model_type": hf["model_type"]}, True


def layer_types_of(hf: dict[str, Any]) -> tuple[str, ...]:
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = int(hf.get("full_attention_interval") or 4)
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def mlp_layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """transformers' rule: MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    n, experts = int(hf["num_hidden_layers"]), int(hf.get("num_experts") or 0)
    step, dense_only = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    return tuple("sparse" if experts > 0 and i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n))


def from_hf(hf: dict[str, Any]) -> HybridConfig:
    model_type = hf["model_type"]
    text, wrapped = text_config(hf)
    if model_type not in PROJECTIONS:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a hybrid Qwen model")
    text.setdefault("partial_rotary_factor", 0.25)  # transformers' default for these types
    text.setdefault("intermediate_size", 0)  # Qwen3.5-MoE has no dense layers
    if text.get("rope_parameters") is not None:
        rope = dict(text["rope_parameters"])
        rope.setdefault("partial_rotary_factor", text["partial_rotary_factor"])
        # mrope sections index the vision positions; text tokens have one position, i.e. plain rotary
        text["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    types = mlp_layer_types(text)
    moe = "sparse" in types
    bias = bool(text.get("attention_bias", False))
    moe_fields = dict(n_routed_experts=int(text["num_experts"]), moe_intermediate_size=int(text["moe_intermediate_size"]),
                      num_experts_per_tok=int(text["num_experts_per_tok"]), router="softmax", router_dtype_float32=False,
                      # Qwen3.5-MoE always renormalises the top-k weights; qwen3_next reads norm_topk_prob
                      norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                      shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0)) if moe else {}
    check_supported(text, model_type)
    # hf_config: config.json as given (save_hf writes it back; the text view above is only read here)
    cfg = HybridConfig(**(base_fields(text) | {"hf_config": dict(hf)}), mlp_layer_types=types, qkv_bias=bias, o_bias=bias, qk_norm=True, layer_types=layer_types_of(text),
                 linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
                 linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
                 linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
                 linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
                 linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                 projections=PROJECTIONS[model_type], hf_prefix="model.language_model" if wrapped else "model",
                 kept_hf_prefixes=("mtp.", "model.visual.") if wrapped else ("mtp.",), **moe_fields)
    cfg.validate()
    return cfg
