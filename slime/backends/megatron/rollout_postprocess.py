"""--rollout-data-postprocess-path, upstream's `fn(args, rollout_id, rollout_data)`: called on every train
rank after the log-probs and advantages are computed, before training (where upstream's actor calls it).

`rollout_data` is this rank's share in upstream's layout, one entry per sample: tokens, response_lengths,
total_lengths, rewards, loss_masks (int tensors), advantages, log_probs, ref_log_probs, rollout_log_probs
(float tensors over the response tokens; a key is absent when the run has none). The function may change
the entries in place or replace them; loss_masks, advantages, log_probs, ref_log_probs, rollout_log_probs and
rewards are read back into the batch the step trains on.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from slime.backends.megatron.data import RolloutBatch

# upstream's key -> RolloutBatch field
FIELDS = {"tokens": "tokens", "response_lengths": "response_lengths", "rewards": "rewards",
          "loss_masks": "loss_masks", "advantages": "advantages", "log_probs": "old_log_probs",
          "ref_log_probs": "ref_log_probs", "rollout_log_probs": "rollout_log_probs", "entropy": "entropy"}
PER_TOKEN = ("loss_masks", "advantages", "log_probs", "ref_log_probs", "rollout_log_probs", "entropy")
READ_BACK = PER_TOKEN + ("rewards",)


def _as_tensor(key: str, value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.int64 if key == "loss_masks" else torch.float32)


def postprocess_rollout_data(fn: Callable, args: Any, rollout_id: int, batch: RolloutBatch,
                             mine: Sequence[int]) -> None:
    mine = list(mine)
    data: dict[str, list] = {"total_lengths": [len(batch.tokens[i]) for i in mine]}
    for key, field in FIELDS.items():
        values = getattr(batch, field)
        if values is not None:
            data[key] = [_as_tensor(key, values[i]) if key in PER_TOKEN else values[i] for i in mine]
    fn(args, rollout_id, data)
    for key in READ_BACK:
        if key not in data:
            continue
        values = data[key]
        if len(values) != len(mine):
            raise ValueError(f"--rollout-data-postprocess-path left {len(values)} {key} for {len(mine)} samples")
        field = FIELDS[key]
        out = list(getattr(batch, field) or [None] * len(batch))
        for i, v in zip(mine, values):
            if key in PER_TOKEN:
                v = _as_tensor(key, v).reshape(-1)
                if v.numel() != batch.response_lengths[i]:
                    raise ValueError(f"--rollout-data-postprocess-path: sample {i}'s {key} has {v.numel()} entries "
                                     f"for {batch.response_lengths[i]} response tokens")
                v = v.tolist() if key == "loss_masks" else v
            out[i] = float(v) if key == "rewards" else v
        setattr(batch, field, out)
