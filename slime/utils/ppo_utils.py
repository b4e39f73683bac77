"""RL algorithm formulas: advantage estimators (GAE for PPO), on-policy distillation, PPO/GSPO policy loss,
PPO value loss, KL estimators, TIS.

Per-token tensors are flat over the response tokens of one or more samples; `lengths` gives
each sample's response length in order (segments of the flat tensor). Pure torch, no device code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

GRPO_STD_EPS = 1e-6  # added to the group std so equal rewards give zero advantage, not NaN
WHITEN_EPS = 1e-8


# --- KL estimators ------------------------------------------------------------------------
def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r with log r = log pi - log pi_ref;
    low_var_kl is k3 clamped to [-10, 10] (guards against exploding ratios).
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2
    if kl_type in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl type {kl_type!r}; use one of k1, k2, k3, low_var_kl")


# --- advantage estimators -----------------------------------------------------------------
def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (n-samples-per-prompt)")
    return rewards.float().view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalization: bool = True) -> torch.Tensor:
    """One advantage per sample: (r - group mean) / (group std + eps); std is the unbiased sample std.
    A group of one has no baseline: its advantage is 0."""
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if std_normalization and group_size > 1:
        centred = centred / (g.std(dim=1, keepdim=True) + GRPO_STD_EPS)
    return centred.reshape(-1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, all_reduce=None) -> torch.Tensor:
    """(v - mean) / sqrt(var + eps) over the masked entries (population variance); unmasked -> 0.
    all_reduce: sums float64 statistics over ranks that each hold part of the batch (None: all here)."""
    def total(*parts: torch.Tensor) -> torch.Tensor:
        t = torch.stack([p.double() for p in parts])
        return all_reduce(t) if all_reduce is not None else t

    mask = mask.to(values.dtype)
    n, weighted = total(mask.sum(), (values * mask).sum())
    mean = (weighted / n.clamp_min(1)).to(values.dtype)
    (sq,) = total(((values - mean).square() * mask).sum())
    var = (sq / n.clamp_min(1)).to(values.dtype)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def _split(flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    if sum(lengths) != flat.numel():
        raise ValueError(f"per-token tensor has {flat.numel()} entries but lengths sum to {sum(lengths)}")
    return list(torch.split(flat, list(lengths)))


def reinforce_plus_plus_returns(rewards: torch.Tensor, kl: torch.Tensor, lengths: Sequence[int],
                                kl_coef: float, gamma: float, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token rewards = -kl_coef * kl on the tokens the loss mask keeps, plus the sample reward on its last
    kept token; returns are the discounted reverse cumulative sums, per sample, and 0 on masked tokens
    (tool output, prompt-like spans: they get neither KL penalty nor return). Flat over tokens."""
    out = []
    mask = torch.ones(sum(lengths)) if loss_mask is None else loss_mask.float()
    for r, k, m in zip(rewards.float(), _split(kl.float(), lengths), _split(mask, lengths)):
        token_rewards = -kl_coef * k * m
        kept = m.nonzero(as_tuple=True)[0]
        if kept.numel():
            token_rewards[kept[-1]] += r
        if gamma == 1.0:
            out.append(token_rewards.flip(0).cumsum(0).flip(0) * m)
            continue
        ret, running = torch.empty_like(token_rewards), torch.zeros((), dtype=token_rewards.dtype)
        for t in range(token_rewards.numel() - 1, -1, -1):
            running = token_rewards[t] + gamma * running
            ret[t] = running
        out.append(ret * m)
    return torch.cat(out) if out else kl.new_zeros(0)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, lengths: Sequence[int], gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation per sample (flat over response tokens), as upstream's PPO: with
    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0), A_t = delta_t + gamma * lambd * A_{t+1},
    returns R_t = A_t + V_t. Every response token takes part (upstream's GAE reads no loss mask)."""
    adv, ret = [], []
    for r, v in zip(_split(token_rewards.float(), lengths), _split(values.float(), lengths)):
        a, running = torch.empty_like(r), torch.zeros((), dtype=r.dtype)
        next_value = torch.zeros((), dtype=v.dtype)
        for t in range(r.numel() - 1, -1, -1):
            running = r[t] + gamma * next_value - v[t] + gamma * lambd * running
            a[t], next_value = running, v[t]
        adv.append(a)
        ret.append(a + v)
    empty = token_rewards.new_zeros(0)
    return (torch.cat(adv), torch.cat(ret)) if adv else (empty, empty)


def ppo_token_rewards(rewards: torch.Tensor, kl: torch.Tensor, lengths: Sequence[int], kl_coef: float) -> torch.Tensor:
    """PPO's token rewards (upstream's): -kl_coef * kl on every response token, plus the sample's reward on its
    last response token."""
    out = []
    for r, k in zip(rewards.float(), _split(kl.float(), lengths)):
        token = -kl_coef * k
        if token.numel():
            token[-1] += r
        out.append(token)
    return torch.cat(out) if out else kl.new_zeros(0)


def opd_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation's per-token reverse KL estimate on the sampled tokens: log pi_student - log
    pi_teacher (upstream's --use-opd term; the advantage gets -opd_kl_coef times it)."""
    return student_log_probs.float() - teacher_log_probs.float()


@dataclass(frozen=True)
class OnPolicyDistillation:
    """--use-opd: the student's (old-policy) and the teacher's log-probs of the sampled tokens, flat like
    the advantages, and --opd-kl-coef."""
    student_log_probs: torch.Tensor
    teacher_log_probs: torch.Tensor
    kl_coef: float


def compute_advantages(estimator: str, rewards: torch.Tensor, lengths: Sequence[int], loss_mask: torch.Tensor,
                       group_size: int, *, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                       gamma: float = 1.0, std_normalization: bool = True,
                       sample_index: Sequence[int] | None = None, all_reduce=None,
                       normalize: bool = False, group_normalize: bool = True,
                       values: torch.Tensor | None = None, lambd: float = 1.0,
                       opd: OnPolicyDistillation | None = None) -> torch.Tensor:
    """Per-token advantages (flat over response tokens) for one rollout batch.

    grpo / gspo: the group-normalised sample advantage on every token.
    reinforce_plus_plus: discounted returns of KL-shaped token rewards, whitened over the batch.
    reinforce_plus_plus_baseline: (reward - group mean) - kl_coef * kl per token, whitened over the batch.
    ppo: GAE (gamma, lambd) of ppo_token_rewards against the critic's `values` (flat, these samples').
    opd (--use-opd): the estimator's advantage minus opd.kl_coef * (student - teacher log-prob), before
    any whitening (upstream's order).
    normalize (--normalize-advantages): grpo / gspo / ppo advantages whitened over the batch too (upstream's
    masked whitening; the reinforce_plus_plus estimators always are, as upstream requires the flag for them).
    group_normalize=False (--disable-rewards-normalization): grpo / gspo / the baseline use the raw rewards.

    A data-parallel share: `rewards` are the whole rollout's, `sample_index` the samples computed here
    (`lengths`, `loss_mask`, `kl`, `values` are theirs); `all_reduce` sums the whitening statistics over the shares.
    """
    lengths = [int(n) for n in lengths]
    rep = torch.tensor(lengths, dtype=torch.long)
    index = torch.arange(rewards.numel()) if sample_index is None else torch.as_tensor(list(sample_index), dtype=torch.long)
    if len(index) != len(lengths):
        raise ValueError(f"{len(lengths)} response lengths for {len(index)} samples")
    if kl is None:
        kl = torch.zeros(sum(lengths))
    whiten = normalize
    if estimator in ("grpo", "gspo"):
        per_sample = (grpo_advantages(rewards, group_size, std_normalization) if group_normalize else rewards)[index]
        adv = torch.repeat_interleave(per_sample, rep)
    elif estimator == "ppo":
        if values is None:
            raise ValueError("--advantage-estimator ppo needs the critic's values of every response token")
        token_rewards = ppo_token_rewards(rewards.float()[index], kl, lengths, kl_coef)
        adv, _ = gae(token_rewards, values, lengths, gamma, lambd)
    elif estimator == "reinforce_plus_plus":
        adv, whiten = reinforce_plus_plus_returns(rewards[index], kl, lengths, kl_coef, gamma, loss_mask), True
    elif estimator == "reinforce_plus_plus_baseline":
        baseline = (grpo_advantages(rewards, group_size, std_normalization=False) if group_normalize
                    else rewards)[index]
        adv, whiten = torch.repeat_interleave(baseline, rep) - kl_coef * kl.float(), True
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if opd is not None:
        adv = adv - opd.kl_coef * opd_reverse_kl(opd.student_log_probs, opd.teacher_log_probs)
    return masked_whiten(adv, loss_mask, all_reduce) if whiten else adv


# --- policy loss --------------------------------------------------------------------------
def gspo_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, lengths: Sequence[int],
                   loss_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's token view of the sequence ratio: each token's value is the sequence's mean masked
    log-ratio, and its gradient is that token's d log pi (s_i,t = sg[s_i] * pi_t / sg[pi_t])."""
    diff = (log_probs - old_log_probs).float() * loss_mask
    seq_mean = torch.stack([
        d.sum() / m.sum().clamp_min(1) for d, m in zip(_split(diff, lengths), _split(loss_mask.float(), lengths))
    ]) if lengths else diff.new_zeros(0)
    per_token = torch.repeat_interleave(seq_mean, torch.tensor([int(n) for n in lengths]))
    return log_probs - log_probs.detach() + per_token.detach()


def policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
                eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss and clip indicator.

    ratio = exp(log_ratio); loss = max(-A*ratio, -A*clip(ratio, 1-eps_clip, 1+eps_clip_high)).
    Dual clip (eps_clip_c > 1): for A < 0 the loss is further capped at -A*eps_clip_c.
    The clip indicator is 1 where the clipped branch is the active (larger) one.
    """
    ratio = torch.exp(log_ratio.float())
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_frac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        capped = torch.minimum(loss, -adv * eps_clip_c)
        clip_frac = torch.where((adv < 0) & (capped < loss), torch.ones_like(clip_frac), clip_frac)
        loss = torch.where(adv < 0, capped, loss)
    return loss, clip_frac


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip: float,
                clip_low: float = 0.0) -> torch.Tensor:
    """Truncated importance weights pi_train_old / pi_rollout, clamped to [clip_low, clip] (no gradient)."""
    w = torch.exp(old_log_probs.float() - rollout_log_probs.float())
    return w.clamp(min=clip_low, max=clip).detach()


# --- reductions ---------------------------------------------------------------------------
def sample_mean_sum(values: torch.Tensor, lengths: Sequence[int], loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's masked token mean (divide by the step's sample count outside)."""
    if not lengths:
        return values.sum() * 0
    parts = zip(_split(values, lengths), _split(loss_mask.to(values.dtype), lengths))
    return torch.stack([(v * m).sum() / m.sum().clamp_min(1) for v, m in parts]).sum()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               value_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss of the critic (upstream's): max((V_clip - R)^2, (V - R)^2) with
    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip); and the indicator |V - V_old| > value_clip."""
    v = values.float()
    old = old_values.float()
    clipped = old + (v - old).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns.float()).square(), (v - returns.float()).square())
    return loss, ((v - old).abs() > value_clip).float()


def opsm_keep(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, lengths: Sequence[int], delta: float) -> tuple[torch.Tensor, float]:
    """Off-policy sequence masking (--use-opsm): per token 0 where the token's advantage is negative and its
    sample's masked mean of old - current log-prob exceeds `delta`, else 1 (flat, no grad); and the masked
    tokens' share of each sample, summed over samples (upstream's opsm_clipfrac)."""
    with torch.no_grad():
        mask = loss_mask.float()
        diff = (old_log_probs.float() - log_probs.float()) * mask
        counts = torch.stack([m.sum() for m in mask.split(list(lengths))]) if lengths else torch.zeros(0)
        seq_kl = torch.stack([d.sum() for d in diff.split(list(lengths))]) / counts.clamp_min(1) if lengths \
            else torch.zeros(0)
        off = (advantages < 0) & (torch.repeat_interleave(seq_kl, torch.as_tensor(list(lengths))) > delta)
        dropped = off.float()
        frac = sum(float(d.sum()) / max(float(c), 1.0) for d, c in zip(dropped.split(list(lengths)), counts))
        return 1.0 - dropped, frac
