"""`--loss-type custom_loss --custom-loss-function-path module.fn`: upstream slime's custom-loss contract,

    def fn(args, batch, logits, sum_of_sample_mean) -> (loss, {name: scalar tensor})

called per micro-batch on the last pipeline stage. `batch` is the micro-batch as upstream's dict:
"unconcat_tokens", "total_lengths", "response_lengths", "loss_masks", "advantages", "log_probs" (old),
"rollout_log_probs", "ref_log_probs", "returns" where present (lists, one tensor per sample);
`logits` the packed [1, T, V] sampling logits (divided by the rollout temperature);
`sum_of_sample_mean(x)` reduces a flat per-response-token tensor as the built-in loss does (the sum of
per-sample masked means, or the masked token sum under --calculate-per-token-loss). The loss is divided by
the step's normalizer as the built-in loss is. train/pg_loss reports the custom loss; log values named like
the built-in metrics (entropy, kl, clip_frac, ppo_kl, tis) are reported under train/<name>.
Context parallel is not supported here (the logits would be one CP rank's share).
"""

from __future__ import annotations

from typing import Any

import torch

from slime.utils import ppo_utils
from slime.utils.misc import load_function


def micro_batch_dict(batch: Any, mb: Any, device: torch.device, old_log_probs: torch.Tensor | None = None
                     ) -> dict[str, Any]:
    idx = list(mb.sample_indices)

    def per_sample(values, dtype=torch.float32):
        return None if values is None else [torch.as_tensor(values[i], dtype=dtype, device=device) for i in idx]

    out = {"unconcat_tokens": per_sample(batch.tokens, torch.long),
           "total_lengths": [len(batch.tokens[i]) for i in idx],
           "response_lengths": [int(batch.response_lengths[i]) for i in idx],
           "loss_masks": per_sample(batch.loss_masks),
           "advantages": per_sample(getattr(batch, "advantages", None)),
           "log_probs": (list(torch.split(old_log_probs.detach().float(), [int(batch.response_lengths[i]) for i in idx]))
                         if old_log_probs is not None else per_sample(getattr(batch, "old_log_probs", None))),
           "rollout_log_probs": per_sample(getattr(batch, "rollout_log_probs", None)),
           "ref_log_probs": per_sample(getattr(batch, "ref_log_probs", None)),
           "rewards": [float(batch.rewards[i]) for i in idx]}
    return {k: v for k, v in out.items() if v is not None}


def custom_loss(args: Any, batch: Any, mb: Any, logits: torch.Tensor, normalizer: float, keys: tuple[str, ...],
                old_log_probs: torch.Tensor | None = None,
                denominators: list[float | None] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss / normalizer, metric sums for `keys`): the user's loss as the built-in loss's stand-in."""
    if mb.cp is not None:
        raise ValueError("--loss-type custom_loss does not support context parallel; use --context-parallel-size 1")
    fn = load_function(args.custom_loss_function_path)
    mask = mb.loss_mask.to(logits.device).float()
    lengths = [int(n) for n in mb.response_lengths]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        if args.calculate_per_token_loss:
            return (x * mask).sum()
        return ppo_utils.sample_mean_sum(x, lengths, mask, denominators)

    loss, log = fn(args, micro_batch_dict(batch, mb, logits.device, old_log_probs), logits, sum_of_sample_mean)
    metrics = {k: 0.0 for k in keys}
    for name, value in (log or {}).items():
        if name in metrics:
            metrics[name] = float(value.detach() if torch.is_tensor(value) else value)
    metrics["pg_loss"] = float(loss.detach())
    return loss / normalizer, metrics
