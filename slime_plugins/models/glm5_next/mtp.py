"""GLM-5.3-Flash's multi-token-prediction (MTP, "nextn") layer, as the published checkpoint stores it and SGLang
0.5.23 serves it (sglang/srt/models/glm5_next_nextn.py: DeepseekV3ForCausalLMNextN over a DeepseekV2DecoderLayer).

The checkpoint keeps it as decoder layer `layers.{N}` (N = num_hidden_layers; `num_nextn_predict_layers` = 1)
under the text model's prefix, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and one DSA decoder layer:
NoPE MLA with its own k-pool indexer, and an MoE (routed + shared experts, SwiGLU clamped at `swiglu_limit`).
Unlike the main layers it has NO hyper-connections: a plain pre-norm residual layer (SGLang builds no hc_*
parameters for it; the published layer-45 inventory holds 1,760 tensors, none of them hc_*), and it stores no
copies of the embedding or the LM head (the draft model uses the target's).

Depth k (1-based) at position t predicts token t + k + 1:
    h_k = Layer_k(eh_proj(cat(enorm(embed(token[t + k])), hnorm(h_{k-1}[t]))))
    logits_k = output_layer(shared_head.norm(h_k))
h_0 is the main model's output after its final collapse (mean over the mHC streams) and norm: the hidden state
SGLang hands the draft model (post-norm, never the streams). The block, the sequence shifting and the placement
under pipeline parallel (last stage, with a copy of the embedding) are GLM-5's (slime_plugins/models/glm5/mtp.py).
The MTP layer's DSA always runs its indexer ("full"); transformers has no MTP module, so the tests build the
reference from transformers' Glm5NextTextAttention / Glm5NextTextMoE / Glm5NextTextRMSNorm.
"""

from __future__ import annotations

from slime_plugins.models.common import spec
from slime_plugins.models.common.weights import REPLICATED, TP_ROWS, WeightMap, mlp_maps
from slime_plugins.models.glm5.mtp import MtpBlock
from slime_plugins.models.glm5_next.attention import NopeMlaDsaAttention, dsa_weight_maps
from slime_plugins.models.glm5_next.layer import clamp_swiglu

__all__ = ["Glm5NextMtpBlock", "mtp_layer_spec", "mtp_maps", "mtp_names"]


def mtp_layer_spec(arch, layer_index: int):
    """megatron's TransformerLayer (plain residual) with the NoPE MLA + indexer and the MoE of layer `layer_index`
    (>= num_hidden_layers: arch.mlp_type gives "sparse", arch.indexer_type "full")."""
    return spec.layer_spec(arch, layer_index, NopeMlaDsaAttention)


class Glm5NextMtpBlock(MtpBlock):
    layer_spec_of = staticmethod(mtp_layer_spec)

    def __init__(self, config, arch) -> None:
        super().__init__(config, arch)
        for layer in self.layers:  # the experts and the shared expert clamp as in the main MoE layers
            clamp_swiglu(layer.transformer_layer.mlp, arch.swiglu_limit)


def mtp_maps(arch, ep_rank: int, ep: int) -> list[WeightMap]:
    """Maps of the MTP block, in the checkpoint's order: the layer's own projections and norms, then its norms,
    attention and MLP as a decoder layer's (no hc_*)."""
    maps = []
    for depth in range(arch.mtp_num_layers):
        layer = arch.num_hidden_layers + depth
        p, hp = f"mtp.layers.{depth}", f"{arch.hf_prefix}.layers.{layer}"
        maps += [WeightMap(f"{p}.enorm.weight", (f"{hp}.enorm.weight",), REPLICATED),
                 WeightMap(f"{p}.hnorm.weight", (f"{hp}.hnorm.weight",), REPLICATED),
                 WeightMap(f"{p}.eh_proj.weight", (f"{hp}.eh_proj.weight",), REPLICATED),
                 WeightMap(f"{p}.final_layernorm.weight", (f"{hp}.shared_head.norm.weight",), REPLICATED)]
        t = f"{p}.transformer_layer"
        decoder = mlp_maps(arch, layer, t, hp, ep_rank, ep)
        maps += decoder[:2] + dsa_weight_maps(arch, layer, f"{t}.self_attention", f"{hp}.self_attn") + decoder[2:]
    return maps


def embedding_copy_map(arch) -> WeightMap:
    """MTP under pipeline parallel: the last stage's copy of the embedding loads from the main embedding (the
    checkpoint has no per-layer copy); export_hf leaves it out, the first stage exports the embedding."""
    return WeightMap("embedding.weight", (f"{arch.hf_prefix}.embed_tokens.weight",), TP_ROWS)


def mtp_names(arch) -> tuple[list[str], dict[str, str]]:
    """(the MTP layers' HF names, {}): the checkpoint keeps no embedding / LM-head copies under them."""
    return [n for m in mtp_maps(arch, 0, 1) for n in m.hf], {}
