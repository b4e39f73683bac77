"""What the shared model code reads from a family's architecture dataclass, and the megatron
TransformerConfig built from it.

A family's dataclass subclasses `ArchConfig` and has these fields (or properties):
    model_type, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, kv_channels (megatron's per-head value width), rms_norm_eps, tie_word_embeddings,
    rope_parameters (dict with rope_type), rotary_dim, mlp_layer_types ("dense" | "sparse" per layer),
    mtp_num_layers, hf_config (the config.json dict, for export);
    MoE (0 / unused without sparse layers): n_routed_experts, n_shared_experts, moe_intermediate_size,
    num_experts_per_tok, router ("sigmoid" | "softmax"), router_dtype_float32, norm_topk_prob,
    n_group, topk_group, routed_scaling_factor.
Importing this module imports no megatron-core (command-line checks parse configs before Ray starts).
"""

from __future__ import annotations

from typing import Any

import torch

from slime_plugins.models.registry import UnsupportedModelError

__all__ = ["ArchConfig", "UnsupportedModelError", "rope_parameters_of"]


def rope_parameters_of(hf: dict[str, Any]) -> dict:
    """transformers 5.x `rope_parameters`, or (older configs) top-level rope_theta / rope_scaling /
    partial_rotary_factor, as one dict with "rope_type"."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", 10000.0)}
        if hf.get("partial_rotary_factor") is not None:
            rope["partial_rotary_factor"] = hf["partial_rotary_factor"]
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


class ArchConfig:
    """Shared behaviour of the families' architecture dataclasses (a mixin: it adds no fields)."""

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @property
    def has_moe(self) -> bool:
        return "sparse" in self.mlp_layer_types

    def mlp_type(self, layer: int) -> str:
        """"dense" | "sparse" of decoder layer `layer`; MTP layers (index >= num_hidden_layers) are MoE."""
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else "sparse"

    def check_layer_types(self) -> None:
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise UnsupportedModelError(f"mlp_layer_types must list 'dense'/'sparse' for each of {self.num_hidden_layers} layers")

    def check_parallel(self, tp: int, ep: int) -> None:
        problems = []
        sizes = [("num_attention_heads", self.num_attention_heads), ("num_key_value_heads", self.num_key_value_heads),
                 ("vocab_size", self.vocab_size)]
        if "dense" in self.mlp_layer_types:
            sizes.append(("intermediate_size", self.intermediate_size))
        if self.has_moe:
            sizes.append(("moe_intermediate_size * n_shared_experts", self.moe_intermediate_size * self.n_shared_experts))
            if self.n_routed_experts % ep:
                problems.append(f"n_routed_experts={self.n_routed_experts} % ep={ep}")
        problems += [f"{name}={size} % tp={tp}" for name, size in sizes if size % tp]
        if problems:
            raise ValueError("model does not split over the requested parallel sizes: " + "; ".join(problems) + " (must be 0)")

    def transformer_config(self, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                           perform_initialization: bool = False, **overrides: Any):
        """megatron TransformerConfig for this model. Sequence parallel is on whenever tp > 1 (the MoE
        layers see each TP rank's own tokens, as megatron requires for MoE with TP), so every forward's
        sequence length (packed T) must be a multiple of tp."""
        from megatron.core.transformer import TransformerConfig

        moe = self.has_moe
        kwargs = dict(
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_key_value_heads,
            ffn_hidden_size=self.intermediate_size,
            kv_channels=self.kv_channels,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            # megatron checks the expert count for expert parallel; our MoE layer reads the architecture
            num_moe_experts=self.n_routed_experts if moe else None,
            moe_router_topk=self.num_experts_per_tok if moe else 2,
            moe_ffn_hidden_size=self.moe_intermediate_size if moe else None,
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
        if pp > 1:
            from slime.backends.megatron.pipeline import stage_layer_counts

            first = overrides.pop("num_layers_in_first_pipeline_stage", None)
            last = overrides.pop("num_layers_in_last_pipeline_stage", None)
            counts = stage_layer_counts(self.num_hidden_layers, pp, first, last)
            if first is None and last is None and len(set(counts)) > 1:  # default uneven split: remainder last
                first, last = counts[0], counts[-1]
            kwargs.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                          # packed micro-batches differ in length: stages exchange each activation's shape
                          # (megatron allows that with its alltoall dispatcher, which our MoE layers' own
                          # all-to-all is; megatron's dispatcher itself is not built)
                          variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        if tp > 1 and overrides.get("sequence_parallel", True) is False:
            raise ValueError("tp > 1 needs sequence parallel with slime's models (MoE expert grads are summed over "
                             "TP ranks); drop sequence_parallel=False and pad sequences to a multiple of tp")
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)
