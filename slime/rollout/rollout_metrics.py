"""Upstream slime's optional rollout metrics, computed from one rollout's samples on the rollout manager:
`--log-passrate`, `--log-multi-turn`, `--log-reward-category`, `--log-correct-samples` (slime.config.
observability_args). Upstream computes the same numbers on the trainer's last stage from its rollout batch; the
samples hold everything they need, so here they are computed once, where the samples are."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any, Sequence

from slime.rollout.rewards import reward_value


def pass_at_k(group_rewards: Sequence[Sequence[float]]) -> dict[str, float]:
    """passrate/pass@k for k = 1, 2, 4, ... <= the group size: the unbiased estimate 1 - C(n-c, k) / C(n, k) per
    group (n samples, c of them with reward exactly 1), averaged over the groups. {} for groups of one."""
    if not group_rewards:
        return {}
    n = len(group_rewards[0])
    if any(len(g) != n for g in group_rewards):
        raise ValueError(f"--log-passrate needs groups of equal size, got sizes {sorted({len(g) for g in group_rewards})}")
    if n <= 1:
        return {}
    out = {}
    for k in (2 ** i for i in range(int(math.log2(n)) + 1)):
        estimates = []
        for rewards in group_rewards:
            c = sum(1 for r in rewards if r == 1)
            estimates.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
        out[f"passrate/pass@{k}"] = statistics.fmean(estimates)
    return out


def _groups(samples: Sequence[Any], key: str | None) -> list[list[float]]:
    by_group: dict[Any, list[float]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_index if s.group_index is not None else ("sample", i), []).append(
            reward_value(s.reward, key))
    return list(by_group.values())


def multi_turn(samples: Sequence[Any], max_response_len: int) -> dict[str, float]:
    """Response lengths with every token (raw) and without the ones not trained (tool output, loss mask 0),
    and the rounds per sample where the generate function records `metadata["round_number"]`."""
    if not samples:
        return {}
    raw = [s.response_length for s in samples]
    trained = [sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples]
    raw_k, obs_k, rnd_k = ("multi_turn/raw_response_length/response_length_",
                           "multi_turn/wo_obs_response_length/response_length_", "multi_turn/multi_turn_metric/round_number_")
    out = {raw_k + "mean": statistics.fmean(raw), raw_k + "max": float(max(raw)), raw_k + "min": float(min(raw)),
           raw_k + "clip_ratio": sum(r >= max_response_len for r in raw) / len(raw),
           obs_k + "mean": statistics.fmean(trained), obs_k + "max": float(max(trained)), obs_k + "min": float(min(trained))}
    rounds = [s.metadata["round_number"] for s in samples if isinstance(s.metadata, dict) and "round_number" in s.metadata]
    if rounds:
        out.update({rnd_k + "mean": statistics.fmean(rounds), rnd_k + "max": float(max(rounds)),
                    rnd_k + "min": float(min(rounds))})
    return out


def reward_categories(samples: Sequence[Any], key: str) -> dict[str, float]:
    """Share of the samples in each category `reward[key]` names (dict rewards)."""
    cats = []
    for s in samples:
        if not isinstance(s.reward, dict) or key not in s.reward:
            raise ValueError(f"--log-reward-category {key!r}: a sample's reward {s.reward!r} is not a dict holding "
                             f"{key!r}; return a dict reward with that key or drop the flag")
        cats.append(s.reward[key])
    return {f"rollout/error_cat/{c}": n / len(cats) for c, n in Counter(cats).items()} if cats else {}


def correct_samples(samples: Sequence[Any], key: str | None, max_response_len: int) -> dict[str, float]:
    """Of the samples with raw reward 1: the share whose response length falls in each quarter of
    --rollout-max-response-len (p25 .. p100), and the mean over them of the per-sample mean -log-prob of the
    trained tokens (the engine's log-probs of its samples)."""
    correct = [s for s in samples if reward_value(s.reward, key) == 1]
    cuts = [max_response_len * q / 4 for q in (1, 2, 3)] + [max_response_len]
    counts = [0, 0, 0, 0]
    for s in correct:
        counts[next((i for i, c in enumerate(cuts) if s.response_length <= c), 3)] += 1
    total = max(len(correct), 1)
    out = {f"rollout/correct_length/p{25 * (i + 1)}": counts[i] / total for i in range(4)}
    per_sample = []
    for s in correct:
        if not s.rollout_log_probs:
            continue
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.rollout_log_probs)
        n = sum(mask)
        if n:
            per_sample.append(-sum(lp * m for lp, m in zip(s.rollout_log_probs, mask)) / n)
    out["rollout/correct_entropy"] = statistics.fmean(per_sample) if per_sample else 0.0
    out["rollout/correct_samples"] = float(len(correct))
    return out


def rollout_metrics(args: Any, samples: Sequence[Any]) -> dict[str, float]:
    """The optional metrics the flags ask for, for one rollout's (or one eval set's) samples."""
    out: dict[str, float] = {}
    key = args.reward_key
    if args.log_passrate:
        out.update(pass_at_k(_groups(samples, key)))
    if args.log_multi_turn:
        out.update(multi_turn(samples, args.rollout_max_response_len))
    if args.log_reward_category:
        out.update(reward_categories(samples, args.log_reward_category))
    if args.log_correct_samples:
        out.update(correct_samples(samples, key, args.rollout_max_response_len))
    return out
