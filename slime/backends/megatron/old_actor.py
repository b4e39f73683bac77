"""--keep-old-actor: host copies of earlier weights, for the old-policy log-probs (upstream's contract).

Upstream keeps an "old_actor" (and, with --update-weights-interval 1, a "rollout_actor") copy next to the actor:
the old log-probs of the PPO ratio come from the old_actor weights, never from the weights being trained. After
every weight sync to the engines the copies move on: with --update-weights-interval 1 as a queue
(old_actor <- rollout_actor, rollout_actor <- the weights just synced), so the old_actor is the one-sync-earlier
weights; with a larger interval old_actor <- the weights just synced. In train_async.py with interval 1 that
makes the old log-probs those of the weights that generated the rollout being trained (it was generated while
the previous one trained). With no sync (--debug-train-only) the copies stay the initial weights.
"""

from __future__ import annotations

import torch


class OldActor:
    def __init__(self, model: torch.nn.Module, update_weights_interval: int) -> None:
        from slime.backends.megatron.model_setup import host_copy

        self.queue = int(update_weights_interval) == 1
        self.weights = host_copy(model)  # old_actor
        self._rollout_actor = host_copy(model) if self.queue else None

    def after_sync(self, model: torch.nn.Module) -> None:
        """The trainer's weights (`model`) were just synced to the engines."""
        from slime.backends.megatron.model_setup import host_copy

        if self.queue:
            self.weights, self._rollout_actor = self._rollout_actor, host_copy(model)
        else:
            self.weights = host_copy(model)
