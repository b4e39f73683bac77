"""The GLM-5.3-Flash model on the shared DecoderModel: vocab-parallel embedding, a TransformerBlock of
Glm5NextDecoderLayers (mHC streams; KDA or DSA token mixer; dense or MoE clamped-SwiGLU MLP), the final
collapse (mean over the streams) and RMSNorm, the vocab-parallel output layer. No rotary anywhere (NoPE)."""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from slime_plugins.models.common import model as common
from slime_plugins.models.glm5_next.hyper import StreamCollapseNorm
from slime_plugins.models.glm5_next.layer import Glm5NextDecoderLayer


class Glm5NextLayers:
    """What the shared block spec reads in place of an attention class (common/spec.py block_spec)."""

    final_norm = StreamCollapseNorm

    @staticmethod
    def layer_spec(arch, layer_index: int) -> ModuleSpec:
        return ModuleSpec(module=Glm5NextDecoderLayer, params={"arch": arch})


def build_model(arch, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True, mtp: bool = False,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized); mtp=True also
    builds the checkpoint's MTP layer(s) (slime_plugins/models/glm5_next/mtp.py)."""
    mtp_block = None
    if mtp:
        from slime_plugins.models.glm5_next.mtp import Glm5NextMtpBlock

        mtp_block = Glm5NextMtpBlock
        config_overrides.setdefault("mtp_num_layers", arch.mtp_num_layers)
    return common.build_model(arch, Glm5NextLayers, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              mtp_block=mtp_block, **config_overrides)
