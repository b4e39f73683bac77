"""A rollout's training data on its way from the rollout manager to the trainer ranks, and the trainer-side
advantages, without the driver ever holding the samples.

The rollout manager packs its samples into a few flat numpy arrays (`pack_samples`, slime.rollout.train_payload)
and puts them in Ray's object store; the driver only forwards the object reference. Every trainer rank reads the
arrays (zero-copy from the node's object store), builds its `RolloutBatch` (`batch_from_payload`), computes the
old/reference log-probs of its own data-parallel share and the advantages of that share (`share_advantages`):
per-sample group statistics come from the rewards of the whole rollout (a few floats), batch-wide whitening from
sums all-reduced over the data-parallel group, so every rank's advantages equal those of one process computing the
whole batch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from slime.backends.megatron.data import RolloutBatch, rollout_denominators, rollout_shares
# the packing moved to the rollout side (the manager packs); kept importable here for tests and plugin code
from slime.rollout.train_payload import pack_samples, payload_summary  # noqa: F401
from slime.utils import ppo_utils

# (tensor) -> the tensor's elementwise sum over the data-parallel ranks (identity in one process)
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def batch_from_payload(payload: dict[str, Any]) -> RolloutBatch:
    offsets, response = payload["offsets"], payload["response_lengths"]
    resp_offsets = np.concatenate([[0], np.cumsum(response)])
    tokens = payload["tokens"]
    rollout_lp = payload["rollout_log_probs"]
    teacher = payload.get("teacher_log_probs")
    n = len(response)
    return RolloutBatch(
        tokens=[tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(n)],
        response_lengths=response.tolist(),
        rewards=payload["rewards"].tolist(),
        loss_masks=[payload["loss_masks"][resp_offsets[i]:resp_offsets[i + 1]].tolist() for i in range(n)],
        rollout_log_probs=None if rollout_lp is None else
        [rollout_lp[resp_offsets[i]:resp_offsets[i + 1]].tolist() for i in range(n)],
        rollout_routed_experts=_routes_per_sample(payload.get("rollout_routed_experts"), offsets),
        rollout_indexer_topk=_routes_per_sample(payload.get("rollout_indexer_topk"), offsets),
        teacher_log_probs=None if teacher is None else
        [torch.from_numpy(teacher[resp_offsets[i]:resp_offsets[i + 1]].copy()) for i in range(n)],
        # absent from a --custom-convert-samples-to-train-data-path payload: one rollout per sample
        rollout_ids=None if payload.get("rollout_ids") is None else payload["rollout_ids"].tolist(),
    )


def _routes_per_sample(routes: np.ndarray | None, offsets: np.ndarray) -> list[torch.Tensor] | None:
    """Sample i's rows: tokens offsets[i] .. offsets[i+1] - 1 less one per earlier sample (its last token)."""
    if routes is None:
        return None
    starts = offsets[:-1] - np.arange(len(offsets) - 1)
    ends = offsets[1:] - np.arange(1, len(offsets))
    # copies: the payload's arrays are read-only views of Ray's object store
    return [torch.from_numpy(np.array(routes[a:b])) for a, b in zip(starts, ends)]


def _sum_all(values: Sequence[float], all_reduce: AllReduce | None) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    return (all_reduce(t) if all_reduce is not None else t).tolist()


def share_advantages(args, batch: RolloutBatch, indices: Sequence[int],
                     all_reduce: "GroupReduce | None" = None) -> dict[str, float]:
    """Fill batch.advantages[i] for the samples `indices` (one data-parallel rank's share; the others stay
    None) and return the advantage / train-rollout log-prob metrics over the whole rollout.

    Needs batch.old_log_probs / ref_log_probs of `indices` when the KL term is used. `all_reduce` reduces
    over the ranks whose shares together are the rollout (None: `indices` is everything)."""
    indices = list(indices)
    lengths = [int(batch.response_lengths[i]) for i in indices]
    mask = torch.cat([torch.tensor(batch.loss_masks[i], dtype=torch.float32) for i in indices]) if indices \
        else torch.zeros(0)
    kl = None
    if batch.ref_log_probs is not None and batch.old_log_probs is not None and indices:
        kl = ppo_utils.approx_kl(torch.cat([batch.old_log_probs[i] for i in indices]),
                                 torch.cat([batch.ref_log_probs[i] for i in indices]), args.kl_loss_type)
    values = None
    if args.advantage_estimator == "ppo":
        values = torch.cat([torch.as_tensor(batch.values[i], dtype=torch.float32) for i in indices]) if indices \
            else torch.zeros(0)
    opd = _opd_inputs(args, batch, indices)
    if args.custom_advantage_function_path:
        adv = _custom_advantages(args, batch, indices, lengths, kl, values)
    else:
        adv = ppo_utils.compute_advantages(
            args.advantage_estimator, torch.tensor(batch.rewards), lengths, mask, reward_group_size(args, len(batch)),
            kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, std_normalization=not args.disable_grpo_std_normalization,
            sample_index=indices, all_reduce=all_reduce, normalize=args.normalize_advantages,
            values=values, lambd=args.lambd, opd=opd, group_normalize=_group_normalize(args))
    advantages: list = [None] * len(batch)
    # numpy, one array per sample: cheap to slice and to pickle (a torch view would carry its whole storage)
    for i, a in zip(indices, torch.split(adv.float().contiguous(), lengths)):
        advantages[i] = a.numpy()
    batch.advantages = advantages
    abs_sum, n_tokens = _sum_all([float((adv.abs() * mask).sum()), float(mask.sum())], all_reduce)
    metrics = {"train/advantage_abs_mean": abs_sum / max(n_tokens, 1.0)}
    if opd is not None:  # upstream's opd_reverse_kl: the per-sample (a forked rollout: per-rollout) masked mean,
        # averaged over rollouts
        reverse_kl = ppo_utils.opd_reverse_kl(opd.student_log_probs, opd.teacher_log_probs)
        denominators, shares = rollout_denominators(batch), rollout_shares(batch)
        per_sample = ppo_utils.sample_mean_sum(reverse_kl, lengths, mask, [denominators[i] for i in indices])
        total, samples = _sum_all([float(per_sample), float(sum(shares[i] for i in indices))], all_reduce)
        metrics["train/opd_reverse_kl"] = total / max(samples, 1.0)
    if batch.rollout_log_probs is not None and batch.old_log_probs is not None:
        # Train-inference mismatch: the trainer's and the engine's log-probs of the same tokens, same weights.
        old = torch.cat([batch.old_log_probs[i] for i in indices]) if indices else torch.zeros(0)
        rollout = torch.cat([torch.tensor(batch.rollout_log_probs[i], dtype=torch.float32) for i in indices]) \
            if indices else torch.zeros(0)
        diff = (old - rollout).abs() * mask
        total, count = _sum_all([float(diff.sum()), float(mask.sum())], all_reduce)
        local_max = float(diff.max()) if diff.numel() else 0.0
        metrics["train_rollout_logprob_abs_diff"] = total / max(count, 1.0)
        metrics["train_rollout_logprob_abs_diff_max"] = all_reduce.max(local_max) if all_reduce else local_max
    elif batch.rollout_log_probs is None:
        metrics["train_rollout_logprob_abs_diff"] = float("nan")
    return metrics


def reward_group_size(args, num_samples: int) -> int:
    """The group size of the reward normalization, upstream's rule (slime/ray/rollout.py
    `_post_process_rewards`): groups of --n-samples-per-prompt when the rollout holds exactly
    --rollout-batch-size x that many samples, else one group of the whole rollout. A custom generate that
    returns several samples for a prompt (an agent session that forked) or none changes the count: the rollout's
    samples then no longer come in fixed-size groups, and upstream normalizes them together. Without a
    --rollout-batch-size (a namespace built for one call), groups of --n-samples-per-prompt."""
    n = args.n_samples_per_prompt or 1
    if args.rollout_batch_size is None or num_samples == n * args.rollout_batch_size:
        return n
    return max(num_samples, 1)


def _group_normalize(args) -> bool:
    # --custom-reward-post-process-path / --custom-convert-samples-to-train-data-path already normalized the
    # rewards (upstream's contract)
    return args.rewards_normalization and not (args.custom_reward_post_process_path
                                               or args.custom_convert_samples_to_train_data_path)


def _custom_advantages(args, batch: RolloutBatch, indices: list[int], lengths: list[int], kl, values) -> torch.Tensor:
    """--custom-advantage-function-path: upstream's `fn(args, rollout_data)` over this rank's samples, which
    sets rollout_data["advantages"] (per-sample tensors; "returns" too, which the critic here computes itself).
    Its rewards are those upstream's estimators see: group-normalized for grpo / gspo (mean only for the
    reinforce_plus_plus baseline) unless --disable-rewards-normalization."""
    from slime.utils.misc import load_function

    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    if _group_normalize(args) and args.advantage_estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"):
        rewards = ppo_utils.grpo_advantages(rewards, reward_group_size(args, len(batch)),
                                            std_normalization=args.advantage_estimator != "reinforce_plus_plus_baseline"
                                            and not args.disable_grpo_std_normalization)

    def per_sample(values_of):
        return None if values_of is None else [torch.as_tensor(values_of[i], dtype=torch.float32) for i in indices]

    data = {"log_probs": per_sample(batch.rollout_log_probs if args.use_rollout_logprobs else batch.old_log_probs),
            "ref_log_probs": per_sample(batch.ref_log_probs), "rollout_log_probs": per_sample(batch.rollout_log_probs),
            "values": None if values is None else list(values.split(lengths)),
            "kl": list((kl if kl is not None else torch.zeros(sum(lengths))).split(lengths)),
            "entropy": per_sample(batch.entropy), "rewards": [float(rewards[i]) for i in indices],
            "response_lengths": list(lengths),
            "loss_masks": per_sample(batch.loss_masks), "total_lengths": [len(batch.tokens[i]) for i in indices]}
    path = args.custom_advantage_function_path
    load_function(path)(args, data)
    out = data.get("advantages")
    if not isinstance(out, (list, tuple)) or len(out) != len(indices):
        raise ValueError(f"--custom-advantage-function-path {path} must set rollout_data['advantages'] to one tensor per "
                         f"sample ({len(indices)}), got {type(out).__name__}")
    flat = [torch.as_tensor(a, dtype=torch.float32).reshape(-1) for a in out]
    bad = [i for i, (a, n) in enumerate(zip(flat, lengths)) if a.numel() != n]
    if bad:
        raise ValueError(f"--custom-advantage-function-path {path}: sample {bad[0]}'s advantages have "
                         f"{flat[bad[0]].numel()} values for {lengths[bad[0]]} response tokens")
    return torch.cat(flat) if flat else torch.zeros(0)


def _opd_inputs(args, batch: RolloutBatch, indices: list[int]) -> "ppo_utils.OnPolicyDistillation | None":
    """--use-opd: the student's log-probs (the old policy's, or the engine's with --use-rollout-logprobs, as
    upstream) and the teacher's of `indices`, flat."""
    if not args.use_opd:
        return None
    if batch.teacher_log_probs is None:
        where = ("the trainer's teacher (--opd-teacher-load)" if args.opd_type == "megatron" else
                 "the rollout: set Sample.teacher_log_probs (e.g. in --custom-reward-post-process-path)")
        raise ValueError(f"--use-opd --opd-type {args.opd_type}: no teacher log-probs for this rollout; they come "
                         f"from {where}")
    student = batch.rollout_log_probs if args.use_rollout_logprobs else batch.old_log_probs
    if student is None:
        raise ValueError("--use-opd needs the student's log-probs of the sampled tokens before training (the "
                         "old-policy pass, or the engine's with --use-rollout-logprobs)")

    def flat(values):
        return torch.cat([torch.as_tensor(values[i], dtype=torch.float32) for i in indices]) if indices \
            else torch.zeros(0)

    return ppo_utils.OnPolicyDistillation(flat(student), flat(batch.teacher_log_probs), float(args.opd_kl_coef))


class GroupReduce:
    """Sums and maxima over a torch.distributed group: what `share_advantages` needs across data-parallel
    ranks. Calling it sums (the `AllReduce` that ppo_utils' whitening takes)."""

    def __init__(self, group) -> None:
        self.group = group

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        import torch.distributed as dist

        return float(self._reduce(torch.tensor([value], dtype=torch.float64), dist.ReduceOp.MAX).item())
