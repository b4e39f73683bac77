"""The MiMo model: qwen2's (the shared GQA DecoderModel) with, for MTP training, glm5/mtp.py's block in MiMo's
wiring. Published modeling_mimo.py (MiMoMTPLayers), depth k at position t:
    x = input_proj(cat(hidden_layernorm(h_{k-1}[t]), token_layernorm(embed(token[t + k]))))
    h_k = final_layernorm(Qwen2DecoderLayer(x));  logits_k = lm_head(h_k)
i.e. DeepSeek-V3's MTP (Megatron's: eh_proj over cat(enorm(e), hnorm(h))) with the projection's input halves in
the other order and the final norm inside the layer. The model holds eh_proj in Megatron's column order, as
upstream's Megatron checkpoints do; the weight map swaps the halves to and from HF's input_proj. HF names:
model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm} and the decoder layer's own
(input_layernorm, self_attn.*, post_attention_layernorm, mlp.*)."""

from __future__ import annotations

import torch

from slime_plugins.models.common import model as common
from slime_plugins.models.common import spec
from slime_plugins.models.common.gqa_attention import GQASelfAttention
from slime_plugins.models.common.gqa_model import layer_maps
from slime_plugins.models.common.weights import REPLICATED, REPLICATED_HALVES_SWAPPED, WeightMap, model_maps, stage_of
from slime_plugins.models.glm5.mtp import MtpBlock


def _mtp_layer_spec(arch, layer_index: int):
    return spec.layer_spec(arch, layer_index, GQASelfAttention)


class MimoMtpBlock(MtpBlock):
    layer_spec_of = staticmethod(_mtp_layer_spec)


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True, mtp: bool = False,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard (megatron model parallel must be initialized); mtp=True also builds the MTP layers."""
    if mtp and pp > 1:
        raise ValueError("MiMo MTP training under pipeline parallel is not supported (the checkpoint holds no copy of "
                         "the embedding for the last stage); use --pipeline-model-parallel-size 1 with "
                         "--enable-mtp-training")
    if mtp:
        config_overrides.setdefault("mtp_num_layers", arch.mtp_num_layers)
    return common.build_model(arch, GQASelfAttention, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              mtp_block=MimoMtpBlock if mtp else None, **config_overrides)


def mtp_maps(arch) -> list[WeightMap]:
    maps = []
    for d in range(arch.mtp_num_layers):
        p, hp = f"mtp.layers.{d}", f"model.mtp_layers.{d}"
        maps += [WeightMap(f"{p}.enorm.weight", (f"{hp}.token_layernorm.weight",), REPLICATED),
                 WeightMap(f"{p}.hnorm.weight", (f"{hp}.hidden_layernorm.weight",), REPLICATED),
                 WeightMap(f"{p}.eh_proj.weight", (f"{hp}.input_proj.weight",), REPLICATED_HALVES_SWAPPED),
                 WeightMap(f"{p}.final_layernorm.weight", (f"{hp}.final_layernorm.weight",), REPLICATED)]
        maps += layer_maps(arch, arch.num_hidden_layers + d, f"{p}.transformer_layer", hp, 0, 1)
    return maps


def mtp_names(arch) -> tuple[list[str], dict[str, str]]:
    """(MTP tensor names, {}): MiMo's MTP layers use the main embedding and lm_head, stored once."""
    return [n for m in mtp_maps(arch) for n in m.hf], {}


def maps_for_model(model) -> list[WeightMap]:
    offset, n, pre, post, ep_rank, ep = stage_of(model)
    maps = model_maps(model.arch, layer_maps, offset, n, pre, post, ep_rank, ep)
    if getattr(model, "mtp", None) is not None:
        maps += mtp_maps(model.arch)
    return maps
