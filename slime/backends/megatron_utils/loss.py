"""Upstream slime's `slime.backends.megatron_utils.loss` helper for custom losses (`--loss-type custom_loss`).

    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"], with_entropy=True)
    out["log_probs"], out["entropy"]  # one tensor per sample, over its response tokens

`logits` is the micro-batch's packed [1, T, V] (or [T, V]) output, samples back to back in batch order,
already divided by the rollout temperature (the trainer hands the custom loss its sampling logits).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def get_log_probs_and_entropy(logits: torch.Tensor, *, args: Any = None, unconcat_tokens: Sequence[torch.Tensor],
                              total_lengths: Sequence[int], response_lengths: Sequence[int],
                              with_entropy: bool = False, **_: Any) -> tuple[torch.Tensor, dict[str, list]]:
    flat = logits.reshape(-1, logits.shape[-1])
    log_probs, entropies = [], []
    offset = 0
    for tokens, total, n in zip(unconcat_tokens, total_lengths, response_lengths):
        total, n = int(total), int(n)
        rows = torch.arange(offset + total - n - 1, offset + total - 1, device=flat.device)  # row p scores token p+1
        targets = torch.as_tensor(tokens, device=flat.device)[total - n:total].long()
        logp = torch.log_softmax(flat.index_select(0, rows).float(), dim=-1)
        log_probs.append(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropies.append(-(logp.exp() * logp).sum(-1))
        offset += total
    out = {"log_probs": log_probs}
    if with_entropy:
        out["entropy"] = entropies
    return logits, out
