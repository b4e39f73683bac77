"""megatron-core layer specs shared by every family: megatron's TransformerLayer with the family's
attention module, our RMSNorm and a dense SwiGLU or MoE MLP (`arch.mlp_type(layer)`). One spec per layer."""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from slime_plugins.models.common.layers import RMSNorm, SwiGLUMLP
from slime_plugins.models.common.moe import MoELayer


def layer_spec(arch, layer_index: int, attention: type) -> ModuleSpec:
    """Decoder layer `layer_index` (global, 0-based): `attention` is built with params {"arch": arch}."""
    # Plain classes, not ModuleSpecs: megatron's TransformerLayer then passes only `config` to them.
    # A family whose dense MLP or MoE layer differs (GLM-4 norms the dense output, Qwen3-Next gates the shared
    # expert) names it on its attention class.
    dense = getattr(attention, "dense_mlp", SwiGLUMLP)
    moe = getattr(attention, "moe_mlp", MoELayer)
    mlp = moe.bound_to(arch) if arch.mlp_type(layer_index) == "sparse" else dense
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(module=attention, params={"arch": arch}),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(arch, config, attention: type, pp_rank: int | None = None,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Specs of the layers this pipeline stage builds, and the final norm."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    # A family whose decoder layer is not megatron's TransformerLayer (glm5_next's hyper-connection streams)
    # names its layer spec and final norm on the attention class.
    spec_of = getattr(attention, "layer_spec", None) or (lambda a, i: layer_spec(a, i, attention))
    return TransformerBlockSubmodules(layer_specs=[spec_of(arch, offset + i) for i in range(n)],
                                      layer_norm=getattr(attention, "final_norm", RMSNorm))
