"""megatron-core layer specs for the GLM-5 family: megatron's TransformerLayer with our MLA(+DSA)
attention, RMSNorm and dense / MoE MLPs. One spec per layer (first-k dense layers, then MoE)."""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from slime_plugins.models.glm5.attention import MLASelfAttention
from slime_plugins.models.glm5.config import GlmConfig
from slime_plugins.models.glm5.layers import RMSNorm, SwiGLUMLP
from slime_plugins.models.glm5.moe import GlmMoE


def layer_spec(glm: GlmConfig, layer_index: int) -> ModuleSpec:
    # Plain classes, not ModuleSpecs: megatron's TransformerLayer then passes only `config` to them.
    mlp = GlmMoE.bound_to(glm) if glm.mlp_type(layer_index) == "sparse" else SwiGLUMLP
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(module=MLASelfAttention, params={"glm": glm}),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(glm: GlmConfig, config, pp_rank: int | None = None, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Specs of the layers this pipeline stage builds, and the final norm."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(glm, offset + i) for i in range(n)], layer_norm=RMSNorm)
