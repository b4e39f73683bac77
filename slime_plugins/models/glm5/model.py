"""The GLM-5-family model: the shared DecoderModel with MLA (+DSA) attention and GLM MoE layers."""

from __future__ import annotations

import torch

from slime_plugins.models.common import model as common
from slime_plugins.models.glm5.attention import MLASelfAttention, layer_spec  # noqa: F401 (also this module's API)
from slime_plugins.models.glm5.config import GlmConfig


def build_model(glm: GlmConfig, tp: int = 1, ep: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                perform_initialization: bool = False, gather_logits: bool = True, mtp: bool = False,
                **config_overrides) -> common.DecoderModel:
    """This rank's model shard on the accelerator (megatron model parallel must be initialized);
    mtp=True also builds the checkpoint's multi-token-prediction layers."""
    mtp_block = None
    if mtp:
        from slime_plugins.models.glm5.mtp import MtpBlock

        mtp_block = MtpBlock
        config_overrides.setdefault("mtp_num_layers", glm.mtp_num_layers)
    return common.build_model(glm, MLASelfAttention, tp, ep, pp, dtype=dtype,
                              perform_initialization=perform_initialization, gather_logits=gather_logits,
                              mtp_block=mtp_block, **config_overrides)


def mtp_names(glm: GlmConfig) -> tuple[list[str], dict[str, str]]:
    """(MTP tensor names, {per-layer copy: main tensor}) of the checkpoint's MTP layers."""
    from slime_plugins.models.glm5.mtp import mtp_alias_names, mtp_hf_names

    return mtp_hf_names(glm), mtp_alias_names(glm)
