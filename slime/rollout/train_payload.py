"""The trainer's payload of a rollout: the rollout manager packs its samples into a few flat numpy arrays
(`pack_samples`) and puts them in Ray's object store; the driver only forwards the object reference, and every
trainer rank reads the arrays (slime.backends.megatron.rollout_data.batch_from_payload). The format lives on the
rollout side, below both: the manager packs without importing the trainer backend.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def pack_samples(samples: Sequence[Any], reward_key: str | None = None) -> dict[str, Any]:
    """Flat arrays of the fields the trainer needs (tokens, response lengths, rewards, loss masks, engine
    log-probs). Numpy buffers travel through Ray's object store without a per-sample pickle. A dict
    reward is read at `reward_key` (--reward-key)."""
    # at call time: the trainer ranks import this module (through rollout_data) without the reward graders
    from slime.rollout.rewards import reward_value

    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    response = np.array([int(s.response_length) for s in samples], dtype=np.int64)
    # a sample marked remove_sample (--rollout-sample-filter-path) stays in the batch without loss
    masks = [[0] * int(s.response_length) if getattr(s, "remove_sample", False) else
             s.loss_mask if s.loss_mask is not None else [1] * int(s.response_length) for s in samples]
    with_lp = bool(samples) and all(s.rollout_log_probs is not None for s in samples)
    # --use-opd --opd-type sglang: the teacher's log-probs a reward post-process put on every sample
    with_teacher = bool(samples) and all(getattr(s, "teacher_log_probs", None) is not None for s in samples)
    return {
        "tokens": np.fromiter((t for s in samples for t in s.tokens), dtype=np.int64, count=int(lengths.sum())),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "response_lengths": response,
        "rewards": np.array([reward_value(s.reward, reward_key) for s in samples], dtype=np.float64),
        "loss_masks": np.fromiter((m for mask in masks for m in mask), dtype=np.int8, count=int(response.sum())),
        "rollout_log_probs": np.fromiter((x for s in samples for x in s.rollout_log_probs), dtype=np.float32,
                                         count=int(response.sum())) if with_lp else None,
        # --use-rollout-routing-replay: the engines' experts of each sample's fed tokens, int32 [sum(len - 1), L, k]
        "rollout_routed_experts": _routes_of(samples, lengths, masks),
        # --use-rollout-indexer-replay: the engines' DSA selections, int32 [sum(len - 1), L, width] (same rows)
        "rollout_indexer_topk": _routes_of(samples, lengths, masks, "rollout_indexer_topk"),
        "teacher_log_probs": np.concatenate([_teacher_of(s) for s in samples]) if with_teacher else None,
        "rollout_ids": rollout_ids_of(samples),
    }


def rollout_ids_of(samples: Sequence[Any]) -> np.ndarray:
    """Each sample's rollout (upstream's train_data["rollout_ids"]): `Sample.rollout_id`, shared by the samples one
    execution gave (a forked agent session); a sample without one is a rollout of its own, numbered as upstream
    does (the smallest ids no other sample holds, in sample order). The trainer's steps take whole rollouts."""
    ids = [getattr(s, "rollout_id", None) for s in samples]
    taken = {int(i) for i in ids if i is not None}
    out, fresh = [], 0
    for i in ids:
        if i is None:
            while fresh in taken:
                fresh += 1
            taken.add(fresh)
            i = fresh
        out.append(int(i))
    return np.array(out, dtype=np.int64)


def _teacher_of(sample) -> np.ndarray:
    values = np.asarray(sample.teacher_log_probs, dtype=np.float32).reshape(-1)
    if values.size != int(sample.response_length):
        raise ValueError(f"sample {getattr(sample, 'index', '?')}: {values.size} teacher log-probs for a response of "
                         f"{sample.response_length} tokens; give one per response token (--use-opd)")
    return values


def _routes_of(samples: Sequence[Any], lengths: np.ndarray, masks: Sequence[Sequence[int]],
               name: str = "rollout_routed_experts") -> np.ndarray | None:
    """The per-token rows `name` of every sample (one per token but the last), concatenated; None if one lacks them.
    A sample whose last piece is a tool or environment turn has rows only for the tokens the engine was fed (its
    last request's); the rows of the tokens after them are NOT_FED (the trainer keeps its own choice there). Those
    tokens may only precede untrained ones: a trained token needs every earlier token's row."""
    if not samples or any(getattr(s, name, None) is None for s in samples):
        return None
    from slime.utils.routing_replay import NOT_FED

    routes = [np.asarray(getattr(s, name), dtype=np.int32) for s in samples]
    for k, (s, r, n, mask) in enumerate(zip(samples, routes, lengths, masks)):
        fed = r.shape[0] if r.ndim == 3 else n - 1
        if fed < n - 1:
            trained = [t for t, m in enumerate(mask, start=n - len(mask)) if m and t > fed]
            if trained:
                raise ValueError(f"sample {getattr(s, 'index', '?')}: {name} covers the first {fed} tokens the engine "
                                 f"was fed, but token {trained[0]} of {n} after them is trained; a model turn needs "
                                 "its meta_info (append_response_tokens(..., meta_info=...))")
            routes[k] = r = np.concatenate([r, np.full((n - 1 - fed, *r.shape[1:]), NOT_FED, dtype=np.int32)])
        if r.ndim != 3 or r.shape[0] != n - 1:
            raise ValueError(f"sample {getattr(s, 'index', '?')}: {name} has shape {r.shape}, expected "
                             f"({n - 1}, layers, k): one row per token but the last")
    return np.concatenate(routes)


def payload_summary(payload: dict[str, Any]) -> dict[str, float]:
    """Rollout metrics that need only the rewards and lengths (computed where the payload is made)."""
    rewards, lengths = payload["rewards"], payload["response_lengths"].astype(np.float64)
    return {
        "rollout/reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
        "rollout/reward_std": float(rewards.std()) if rewards.size else float("nan"),
        "rollout/response_len_mean": float(lengths.mean()) if lengths.size else float("nan"),
        "rollout/samples": float(rewards.size),
        "rollout/response_tokens": float(lengths.sum()),
    }
