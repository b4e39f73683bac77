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
    from slime.accelerator import get_accelerator

    flat = logits.reshape(-1, logits.shape[-1])
    rows, targets, lengths = [], [], []
    offset = 0
    for tokens, total, n in zip(unconcat_tokens, total_lengths, response_lengths):
        total, n = int(total), int(n)
        rows.append(torch.arange(offset + total - n - 1, offset + total - 1))  # row p scores token p+1
        targets.append(torch.as_tensor(tokens).reshape(-1)[total - n:total].long().cpu())
        lengths.append(n)
        offset += total
    if not rows:
        return logits, {"log_probs": [], **({"entropy": []} if with_entropy else {})}
    # The trainer's own scoring (chunked over the vocabulary, the accelerator's kernel where it has one).
    log_probs, entropy = get_accelerator().ops.token_log_probs(flat.index_select(0, torch.cat(rows).to(flat.device)),
                                                               torch.cat(targets).to(flat.device))
    out = {"log_probs": list(torch.split(log_probs.float(), lengths))}
    if with_entropy:
        out["entropy"] = list(torch.split(entropy.float(), lengths))
    return logits, out
