"""`--rollout-function-path slime.rollout.sft_rollout.generate_rollout`: SFT data as a rollout (upstream
slime's contract). Each prompt of --prompt-data (--input-key naming a list of chat messages) becomes one
sample: the conversation's tokens, the response from the first trained token on, its loss mask
(slime.utils.mask_utils, --loss-mask-type) and reward 0. No engine is asked anything; run it with
--loss-type sft_loss and --debug-train-only.
"""

from __future__ import annotations

import logging
from typing import Any

from slime.utils.mask_utils import MultiTurnLossMaskGenerator

__all__ = ["generate_rollout"]

logger = logging.getLogger(__name__)
_MASKERS: dict[tuple[str, str], MultiTurnLossMaskGenerator] = {}


def _masker(args: Any) -> MultiTurnLossMaskGenerator:
    key = (args.hf_checkpoint, args.loss_mask_type)
    if key not in _MASKERS:
        from transformers import AutoTokenizer

        _MASKERS[key] = MultiTurnLossMaskGenerator(AutoTokenizer.from_pretrained(args.hf_checkpoint),
                                                   args.loss_mask_type)
    return _MASKERS[key]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> list:
    if evaluation:
        raise ValueError("slime.rollout.sft_rollout has no evaluation rollout; leave --eval-prompt-data unset")
    masker = _masker(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            messages = sample.prompt
            if not isinstance(messages, list):
                raise ValueError(f"sample {sample.index}: --input-key must name a list of chat messages for SFT, "
                                 f"got {type(messages).__name__}")
            tokens, mask = masker.get_loss_mask(messages, tools=(sample.metadata or {}).get("tools"))
            (n,) = masker.get_response_lengths([mask])
            if n == 0:
                raise ValueError(f"sample {sample.index}: no assistant turn to train on")
            if n == len(tokens):
                raise ValueError(f"sample {sample.index}: the conversation starts with a trained token; "
                                 "an SFT sample needs a prompt before its first assistant turn")
            sample.tokens, sample.response_length = tokens, n
            sample.loss_mask = mask[-n:]
            sample.reward = 0.0
    logger.debug("sft rollout %d: %d samples", rollout_id, sum(len(g) for g in groups))
    return groups
