"""RL algorithm formulas: advantage estimators (GAE for PPO), on-policy distillation, PPO/GSPO policy loss,
PPO value loss, KL estimators, TIS.

Per-token tensors are flat over the response tokens of one or more samples; `lengths` gives
each sample's response length in order (segments of the flat tensor). Pure torch, no device code.
"""

from __future__ import annotations

from argparse import Namespace
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

    grpo / gspo / cispo: the group-normalised sample advantage on every token.
    reinforce_plus_plus: discounted returns of KL-shaped token rewards, whitened over the batch.
    reinforce_plus_plus_baseline: (reward - group mean) - kl_coef * kl per token, whitened over the batch.
    ppo: GAE (gamma, lambd) of ppo_token_rewards against the critic's `values` (flat, these samples').
    opd (--use-opd): the estimator's advantage minus opd.kl_coef * (student - teacher log-prob), before
    any whitening (upstream's order).
    normalize (--normalize-advantages): grpo / gspo / cispo / ppo advantages whitened over the batch too (upstream's
    masked whitening; the reinforce_plus_plus estimators always are, as upstream requires the flag for them).
    group_normalize=False (--disable-rewards-normalization): grpo / gspo / cispo / the baseline use the raw rewards.

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
    if estimator in ("grpo", "gspo", "cispo"):
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


def cispo_loss(log_ratio: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
               eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss (MiniMax-M1, arXiv 2506.13585, eq. 4-5) and clip indicator:
    -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_prob. The clipped ratio is a constant weight,
    so clipped tokens still pass their gradient through log_prob (PPO's clip zeroes it); eps_clip >= 1
    removes the lower bound (the canonical setting). The indicator is 1 where the clip changed the ratio."""
    ratio = torch.exp(log_ratio.float())
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -clipped.detach() * advantages.float() * log_probs.float(), (clipped != ratio).float()


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip: float,
                clip_low: float = 0.0) -> torch.Tensor:
    """Truncated importance weights pi_train_old / pi_rollout, clamped to [clip_low, clip] (no gradient)."""
    w = torch.exp(old_log_probs.float() - rollout_log_probs.float())
    return w.clamp(min=clip_low, max=clip).detach()


# --- reductions ---------------------------------------------------------------------------
def sample_mean_sum(values: torch.Tensor, lengths: Sequence[int], loss_mask: torch.Tensor,
                    denominators: Sequence[float | None] | None = None) -> torch.Tensor:
    """Sum over samples of each sample's masked token sum over its denominator (divide by the step's rollout
    count outside): its own loss-mask total, or where `denominators` gives one (a sample of a rollout with
    several samples), its rollout's loss-mask total, so the rollout's samples add up to one token mean
    (upstream's rollout_mask_sums). None entries keep the sample's own mask sum, the same operations as
    without `denominators`."""
    if not lengths:
        return values.sum() * 0
    if denominators is not None and len(denominators) != len(lengths):
        raise ValueError(f"{len(denominators)} denominators for {len(lengths)} samples")
    parts = zip(_split(values, lengths), _split(loss_mask.to(values.dtype), lengths),
                denominators if denominators is not None else [None] * len(lengths))
    return torch.stack([(v * m).sum() / (m.sum() if d is None else m.new_tensor(float(d))).clamp_min(1)
                        for v, m, d in parts]).sum()


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


# --- upstream's names ---------------------------------------------------------------------
# Upstream slime's names, signatures and semantics over the formulas above, for custom loss / advantage
# functions written for upstream. Shapes follow upstream: the GAE / discounted-return helpers take padded
# [B, T] batches, the per-sample helpers lists of 1-D tensors, calculate_log_probs_and_entropy gives
# log-probs [T, 1] and entropy [T]. Context parallelism is the trainer's business here: whole responses only.

def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """k1 / k2 / k3 / low_var_kl of log_probs against log_probs_base; weighted by importance_ratio when given
    (DeepSeek-V3.2's unbiased estimate), the low_var_kl clamp to [-10, 10] applied after the weighting."""
    if kl_loss_type not in ("k1", "k2", "k3", "low_var_kl"):
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    kl = approx_kl(log_probs, log_probs_base, "k3" if kl_loss_type == "low_var_kl" else kl_loss_type)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10, 10) if kl_loss_type == "low_var_kl" else kl


def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped loss per token from ppo_kl = old - new log-prob; the clip fraction marks the tokens where
    the ratio clip is active (upstream's: before the dual clip's cap)."""
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, "
                         f"but get the value: {eps_clip_c}.")
    loss, clipfrac = policy_loss(-ppo_kl, advantages, eps_clip, eps_clip_high)
    if eps_clip_c is not None:
        loss, _ = policy_loss(-ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)
    return loss, clipfrac


def compute_cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                       eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_prob per token."""
    return cispo_loss(-ppo_kl, log_probs, advantages, eps_clip, eps_clip_high)


def compute_opsm_mask(args: Namespace, full_log_probs: list[torch.Tensor], full_old_log_probs: list[torch.Tensor],
                      advantages: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking over per-sample lists: (flat keep mask, summed masked share) with
    args.opsm_delta."""
    lengths = [int(x.numel()) for x in full_log_probs]
    keep, frac = opsm_keep(torch.cat(full_log_probs), torch.cat(full_old_log_probs), torch.cat(advantages),
                           torch.cat(loss_masks), lengths, args.opsm_delta)
    return keep, torch.tensor(frac, device=advantages[0].device)


def compute_gspo_kl(full_log_probs: list[torch.Tensor], full_old_log_probs: list[torch.Tensor],
                    local_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """Each sample's masked mean of old - new log-prob, on every one of its tokens (flat)."""
    per_sample = [((old - new) * m).sum() / torch.clamp_min(m.sum(), 1)
                  for new, old, m in zip(full_log_probs, full_old_log_probs, loss_masks)]
    return torch.cat([kl.expand_as(local) for kl, local in zip(per_sample, local_log_probs)])


def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sample's (already normalised) reward on each of its tokens."""
    return [torch.ones_like(k) * r for r, k in zip(rewards, kl)]


def get_reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, kl: list[torch.Tensor],
                                                loss_masks: list[torch.Tensor], kl_coef: float) -> list[torch.Tensor]:
    """Unwhitened REINFORCE++-baseline advantages: reward (group mean already taken off) - kl_coef * kl."""
    return [torch.ones_like(k) * r - kl_coef * k for k, r in zip(kl, rewards)]


def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float):
    """GAE over [B, T] (the value after the last position is 0): (advantages, returns = advantages + values)."""
    batch, length = rewards.shape
    adv, ret = gae(rewards.reshape(-1), values.reshape(-1), [length] * batch, gamma, lambd)
    return adv.view(batch, length).to(rewards.dtype), ret.view(batch, length).to(rewards.dtype)


def chunked_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float, chunk_size: int = 128):
    """Upstream's chunked-scan GAE: the same values as vanilla_gae (chunk_size only sets upstream's work split)."""
    if rewards.ndim != 2 or values.shape != rewards.shape:
        raise ValueError(f"rewards and values must both be [B, T], got {tuple(rewards.shape)} and {tuple(values.shape)}")
    return vanilla_gae(rewards, values, gamma, lambd)


def chunked_discounted_returns(rewards: torch.Tensor, discount: float, chunk_size: int = 128) -> torch.Tensor:
    """[B, T] returns G_t = r_t + discount * G_{t+1} (GAE with zero values and lambda 1)."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, T], got {tuple(rewards.shape)}")
    batch, length = rewards.shape
    returns, _ = gae(rewards.reshape(-1), torch.zeros(batch * length), [length] * batch, discount, 1.0)
    return returns.view(batch, length).to(rewards.dtype)


def get_reinforce_plus_plus_returns(rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor],
                                    response_lengths: list[int], total_lengths: list[int], kl_coef: float,
                                    gamma: float) -> list[torch.Tensor]:
    """REINFORCE++ returns per sample: token rewards -kl_coef * kl on kept tokens plus the reward on the last
    kept token, discounted by gamma over every response token (masked ones carry the return through)."""
    out = []
    for i, (reward, k, mask) in enumerate(zip(rewards, kl, loss_masks)):
        if not mask.sum().item() > 0:
            raise ValueError(f"Sequence at index {i} is fully masked.")
        token_rewards = -kl_coef * (k * mask)
        token_rewards[mask.nonzero(as_tuple=True)[0][-1]] += reward
        out.append(chunked_discounted_returns(token_rewards.view(1, -1), gamma)[0])
    return out


def get_advantages_and_returns_batch(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd,
                                     chunked: bool = True):
    """Per-sample GAE: (advantages, returns), lists like values_list."""
    with torch.no_grad():
        lengths = [int(n) for n in response_lengths]
        adv, ret = gae(torch.cat([r[:n] for r, n in zip(rewards_list, lengths)]),
                       torch.cat([v[:n] for v, n in zip(values_list, lengths)]), lengths, gamma, lambd)
        dtype = values_list[0].dtype
        return list(adv.to(dtype).split(lengths)), list(ret.to(dtype).split(lengths))


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy: bool = False, chunk_size: int = -1,
                                    log_prob_keep_mask=None, with_entropy_grad: bool = True):
    """logits [T, V], tokens [T] -> (log-probs [T, 1], entropy [T] or None), with the accelerator's
    token_log_probs. log_prob_keep_mask [T, V] (top-k / top-p sampling): log-probs over the kept vocabulary
    (the target always kept), entropy over the whole one. Vocab-parallel logits (a tp_group of several ranks)
    are gathered by the trainer before this point here, so they are refused."""
    from slime.accelerator import get_accelerator

    if tp_group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(tp_group) > 1:
        raise ValueError("calculate_log_probs_and_entropy: vocab-parallel logits (tp_group of "
                         f"{torch.distributed.get_world_size(tp_group)} ranks) are not supported; pass whole-vocab logits")
    if logits.size(0) == 0:
        return logits.new_zeros((0,)), (logits.new_zeros((0,)) if with_entropy else None)
    score = get_accelerator().ops.token_log_probs
    chunk = chunk_size if chunk_size > 0 else None
    log_prob, entropy = score(logits.contiguous(), tokens, chunk)
    if log_prob_keep_mask is not None:
        keep = log_prob_keep_mask.clone()
        keep[torch.arange(tokens.numel()), tokens.long()] = True
        masked = logits.float().masked_fill(~keep, float("-inf"))
        log_prob = masked.gather(-1, tokens.long().view(-1, 1)).squeeze(-1) - masked.logsumexp(-1)
    if not with_entropy:
        return log_prob.unsqueeze(-1), None
    return log_prob.unsqueeze(-1), (entropy if with_entropy_grad else entropy.detach())
