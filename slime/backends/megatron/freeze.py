"""--only-train-params-name-list / --freeze-params-name-list (upstream's): which parameters the optimizer
updates, by regular expressions (re.search) over the parameter names. A pattern matches a parameter by this
model's name (HF-like: `decoder.layers.3.self_attention.q_a_proj.weight`, `mlp.experts.weight1`) or by the name
upstream's Megatron GPTModel gives it (`...self_attention.linear_q_down_proj.weight`,
`mlp.experts.experts.linear_fc1.weight`, `embedding.word_embeddings.weight`; slime.backends.megatron.
checkpoint_keys), so upstream's patterns select the same weights. Layer numbers are the pipeline stage's own, as
in upstream. Applied before Megatron's DDP and optimizer are built, which then leave frozen parameters out of the grad
buffers and the optimizer state; the weight sync and checkpoints still carry every parameter."""

from __future__ import annotations

import logging
import re
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def _upstream_names(arch, name: str) -> tuple[str, ...]:
    if arch is None:
        return ()
    from slime.backends.megatron.checkpoint.keys import upstream_key

    try:
        return (upstream_key(arch, name),)
    except (AttributeError, KeyError, TypeError):  # a tensor upstream's layout has no name for
        return ()


def freeze_parameters(model: torch.nn.Module, only_train: Sequence[str] | None,
                      freeze: Sequence[str] | None) -> tuple[int, int]:
    """Set requires_grad by the two lists (only_train first: everything else frozen; then freeze). Returns
    (trainable, frozen) parameter counts of this rank's shard."""
    try:
        only = [re.compile(p) for p in only_train or []]
        frozen = [re.compile(p) for p in freeze or []]
    except re.error as e:
        raise ValueError(f"--only-train-params-name-list / --freeze-params-name-list: bad regular expression "
                         f"{e.pattern!r} ({e}); fix the pattern") from None
    if not only and not frozen:
        return sum(p.requires_grad for p in model.parameters()), 0
    arch = getattr(model, "arch", None)
    for name, param in model.named_parameters():
        names = (name,) + _upstream_names(arch, name)
        if only:
            param.requires_grad = any(p.search(n) for p in only for n in names)
        if any(p.search(n) for p in frozen for n in names):
            param.requires_grad = False
    trainable = sum(p.requires_grad for p in model.parameters())
    total = sum(1 for _ in model.parameters())
    logger.info("parameters: %d trainable, %d frozen (--only-train-params-name-list / --freeze-params-name-list)",
                trainable, total - trainable)
    return trainable, total - trainable
