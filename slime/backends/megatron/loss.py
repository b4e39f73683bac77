"""The RL training objective of one micro-batch, built from slime.utils.ppo_utils formulas.

loss = policy_loss * tis - entropy_coef * entropy + kl_loss_coef * kl(actor || ref),
each term reduced per sample (masked token mean; a rollout of several samples, an agent's forked
session, one token mean over all its samples, as upstream) and summed over samples, then divided by
the step's rollout count on this rank (or, with --calculate-per-token-loss, summed over tokens
and divided by the step's token count). Gradients over micro-batches then add up to the step mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from slime.utils import ppo_utils


@dataclass(frozen=True)
class LossConfig:
    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    per_token_loss: bool = False
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    get_mismatch_metrics: bool = False

    @classmethod
    def from_args(cls, args) -> "LossConfig":
        return cls(
            advantage_estimator=args.advantage_estimator, eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high if args.eps_clip_high is not None else args.eps_clip,
            eps_clip_c=args.eps_clip_c, use_kl_loss=args.use_kl_loss, kl_loss_coef=args.kl_loss_coef,
            kl_loss_type=args.kl_loss_type, use_unbiased_kl=args.use_unbiased_kl, entropy_coef=args.entropy_coef,
            use_tis=args.use_tis,
            tis_clip=args.tis_clip, tis_clip_low=args.tis_clip_low, per_token_loss=args.calculate_per_token_loss,
            use_opsm=args.use_opsm, opsm_delta=args.opsm_delta, get_mismatch_metrics=args.get_mismatch_metrics,
        )


@dataclass(frozen=True)
class LossHooks:
    """Upstream's trainer-side loss hooks, loaded once per actor:
    --custom-tis-function-path  fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                                   total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)
    --custom-pg-loss-reducer-function-path  fn(total_lengths, response_lengths, loss_masks,
                                   calculate_per_token_loss) -> reducer, reducer(pg_loss) -> scalar
    Per-sample values are lists of 1-D tensors over each sample's response tokens; pg_loss is flat."""
    args: Any = None
    tis_function: Callable | None = None
    pg_loss_reducer: Callable | None = None

    @classmethod
    def from_args(cls, args) -> "LossHooks":
        from slime.utils.misc import load_function

        tis, reducer = args.custom_tis_function_path, args.custom_pg_loss_reducer_function_path
        return cls(args, load_function(tis) if tis else None, load_function(reducer) if reducer else None)

    @property
    def any(self) -> bool:
        return self.tis_function is not None or self.pg_loss_reducer is not None


def _custom_tis(hooks: LossHooks, pg_loss, old_log_probs, rollout_log_probs, mask, lengths, total_lengths):
    """Upstream's TIS/RS call: the function reweights pg_loss and may reject tokens (loss masks it returns)."""
    out = hooks.tis_function(args=hooks.args, pg_loss=pg_loss, train_log_probs=list(old_log_probs.split(lengths)),
                             rollout_log_probs=list(rollout_log_probs.split(lengths)),
                             loss_masks=list(mask.split(lengths)), total_lengths=list(total_lengths),
                             response_lengths=list(lengths))
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError("--custom-tis-function-path must return (pg_loss, loss_masks, metrics)")
    new_pg, new_masks, metrics = out
    kept = torch.cat([torch.as_tensor(m, dtype=torch.float32, device=mask.device).reshape(-1) for m in new_masks])
    if new_pg.shape != pg_loss.shape or kept.shape != mask.shape:
        raise ValueError(f"--custom-tis-function-path returned pg_loss {tuple(new_pg.shape)} and loss masks of "
                         f"{kept.numel()} tokens; expected {tuple(pg_loss.shape)} and {mask.numel()}")
    return new_pg, kept, metrics or {}


# Metrics returned as sums (of per-sample means, or of tokens in per-token mode); divide by the count.
METRIC_KEYS = ("pg_loss", "entropy", "kl", "clip_frac", "ppo_kl", "tis")
# --get-mismatch-metrics (upstream's names): the old / rollout ratio (tis) clipped at --tis-clip-low /
# --tis-clip (tis_clipfrac), |ratio - 1| (tis_abs), and the current / old ratio (ois)
MISMATCH_KEYS = ("tis_clipfrac", "tis_abs", "ois")


def _mismatch_metrics(cfg: "LossConfig", log_probs, old_log_probs, rollout_log_probs, reduce) -> dict[str, float]:
    """Reported, not applied: the loss is weighted only under --use-tis (upstream's flag also runs its TIS
    weighting; train.py says so at start)."""
    if rollout_log_probs is None:
        raise ValueError("--get-mismatch-metrics needs rollout log-probs from the engine (return_logprob)")
    with torch.no_grad():
        ratio = torch.exp(old_log_probs.float() - rollout_log_probs.float())
        clipped = ratio.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip)
        out = {"tis_clipfrac": float(reduce((clipped != ratio).float())), "tis_abs": float(reduce((ratio - 1).abs())),
               "ois": float(reduce(torch.exp(log_probs.float().detach() - old_log_probs.float())))}
        if not cfg.use_tis:
            out["tis"] = float(reduce(ratio))
    return out


def _policy_gradient(cfg: LossConfig, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor, lengths: list[int]):
    """Per-token policy-gradient loss of the estimator (PPO clip, GSPO's sequence ratio, CISPO), with OPSM's
    rejection: (pg_loss, clip_frac, opsm clip fraction or None)."""
    if cfg.advantage_estimator == "gspo":
        log_ratio = ppo_utils.gspo_log_ratio(log_probs, old_log_probs, lengths, mask)
    else:
        log_ratio = log_probs - old_log_probs
    if cfg.advantage_estimator == "cispo":  # upstream's --advantage-estimator cispo: the CISPO loss
        pg_loss, clip_frac = ppo_utils.cispo_loss(log_ratio, log_probs, advantages, cfg.eps_clip, cfg.eps_clip_high)
    else:
        pg_loss, clip_frac = ppo_utils.policy_loss(log_ratio, advantages, cfg.eps_clip, cfg.eps_clip_high,
                                                   cfg.eps_clip_c)
    opsm_frac = None
    if cfg.use_opsm:  # before TIS, as upstream's
        keep_opsm, opsm_frac = ppo_utils.opsm_keep(log_probs, old_log_probs, advantages, mask, lengths, cfg.opsm_delta)
        pg_loss = pg_loss * keep_opsm
    return pg_loss, clip_frac, opsm_frac


def _importance_sampling(cfg: LossConfig, hooks: LossHooks | None, pg_loss: torch.Tensor,
                         old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor | None, mask: torch.Tensor,
                         lengths: list[int], total_lengths: Sequence[int] | None):
    """--use-tis (or a custom TIS/RS function): (weighted pg_loss, the tokens kept in the numerators, the TIS
    weights or None). A custom TIS/RS may reject tokens; the denominators stay the loss mask's."""
    if not cfg.use_tis:
        return pg_loss, mask, None
    if rollout_log_probs is None:
        raise ValueError("--use-tis needs rollout log-probs from the engine (return_logprob)")
    if hooks is not None and hooks.tis_function is not None:
        pg_loss, kept, tis_metrics = _custom_tis(hooks, pg_loss, old_log_probs, rollout_log_probs, mask,
                                                 lengths, total_lengths)
        return pg_loss, kept, tis_metrics.get("tis")
    tis = ppo_utils.tis_weights(old_log_probs, rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low)
    return pg_loss * tis, mask, tis


def _kl(cfg: LossConfig, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
        ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL to the reference (--kl-loss-type; --use-unbiased-kl: upstream's, DeepSeek-V3.2's estimate,
    weighted by pi_theta / pi_old, then clamped)."""
    if not cfg.use_unbiased_kl:
        return ppo_utils.approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type)
    raw = "k3" if cfg.kl_loss_type == "low_var_kl" else cfg.kl_loss_type
    kl = torch.exp(log_probs.float() - old_log_probs.float()) * ppo_utils.approx_kl(log_probs, ref_log_probs, raw)
    return kl.clamp(-10, 10) if cfg.kl_loss_type == "low_var_kl" else kl


def rl_loss(cfg: LossConfig, log_probs: torch.Tensor, entropy: torch.Tensor, old_log_probs: torch.Tensor,
            advantages: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int], normalizer: float,
            ref_log_probs: torch.Tensor | None = None,
            rollout_log_probs: torch.Tensor | None = None, hooks: LossHooks | None = None,
            total_lengths: Sequence[int] | None = None,
            denominators: Sequence[float | None] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (scaled by 1/normalizer) and metric sums for flat per-response-token tensors. hooks: upstream's
    TIS/RS and pg-loss reducer functions (total_lengths, prompt + response per sample, are passed to them).
    denominators: per sample, its rollout's loss-mask total where the rollout has several samples
    (data.rollout_denominators; the per-sample means then add up to one mean per rollout)."""
    if normalizer <= 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    mask = loss_mask.to(torch.float32)
    lengths = [int(n) for n in lengths]
    pg_loss, clip_frac, opsm_frac = _policy_gradient(cfg, log_probs, old_log_probs, advantages, mask, lengths)
    if hooks is not None and hooks.any and total_lengths is None:
        raise ValueError("loss hooks need total_lengths (prompt + response tokens per sample)")
    pg_loss, kept, tis = _importance_sampling(cfg, hooks, pg_loss, old_log_probs, rollout_log_probs, mask, lengths,
                                              total_lengths)

    def reduce(values: torch.Tensor, over: torch.Tensor | None = None) -> torch.Tensor:
        over = kept if over is None else over
        if over is not mask:
            values = values * over
        if cfg.per_token_loss:
            return (values * mask).sum()
        return ppo_utils.sample_mean_sum(values, lengths, mask, denominators)

    if hooks is not None and hooks.pg_loss_reducer is not None:  # e.g. Dr.GRPO's constant denominator
        reducer = hooks.pg_loss_reducer(list(total_lengths), list(lengths), list(kept.split(lengths)),
                                        cfg.per_token_loss)
        pg_term = reducer(pg_loss)
    else:
        pg_term = reduce(pg_loss)
    loss = pg_term
    entropy_sum = reduce(entropy.float())
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * entropy_sum
    kl_sum = None
    if ref_log_probs is not None:
        kl_sum = reduce(_kl(cfg, log_probs, old_log_probs, ref_log_probs))
        if cfg.use_kl_loss and cfg.kl_loss_coef:
            loss = loss + cfg.kl_loss_coef * kl_sum

    with torch.no_grad():
        metrics = {
            "pg_loss": float(pg_term),
            "entropy": float(entropy_sum),
            "kl": float(kl_sum) if kl_sum is not None else 0.0,
            "clip_frac": float(reduce(clip_frac)),
            "ppo_kl": float(reduce(old_log_probs.float() - log_probs.float())),
            # over the tokens before any rejection, as upstream's mismatch metrics
            "tis": float(reduce(tis.detach().float(), over=mask)) if tis is not None else 0.0,
        }
        if opsm_frac is not None:  # a sum over samples (of each one's masked share), like the others
            metrics["opsm_clipfrac"] = opsm_frac
        if cfg.get_mismatch_metrics:  # upstream's mismatch metrics, over the tokens before any rejection
            metrics.update(_mismatch_metrics(cfg, log_probs, old_log_probs, rollout_log_probs,
                                             lambda v: reduce(v, over=mask)))
    return loss / normalizer, metrics


def mtp_loss(mtp_log_probs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], lengths: Sequence[int],
             normalizer: float, scale: float, per_token: bool,
             denominators: Sequence[float | None] | None = None) -> tuple[torch.Tensor, float]:
    """Multi-token prediction loss (--enable-mtp-training), as Megatron's: cross entropy of each MTP depth's
    prediction, masked, times --mtp-loss-scaling-factor / depths. Here on the response tokens of the RL
    loss (masks: loss mask x target exists), reduced like the RL loss (per-sample masked mean, or per token)
    and divided by the same normalizer. Returns (loss, metric sum of the unscaled cross entropy)."""
    lengths = [int(n) for n in lengths]
    total = torch.zeros((), device=mtp_log_probs[0].device) if mtp_log_probs else torch.zeros(())
    for lp, mask in zip(mtp_log_probs, masks):
        ce = -lp.float()
        total = total + ((ce * mask).sum() if per_token else ppo_utils.sample_mean_sum(ce, lengths, mask,
                                                                                        denominators))
    depths = max(len(mtp_log_probs), 1)
    return total * (scale / depths) / normalizer, float(total.detach()) / depths


def sft_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int], normalizer: float,
             per_token: bool, keys: Sequence[str],
             denominators: Sequence[float | None] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """`--loss-type sft_loss` (upstream's): negative log-likelihood of the loss-masked response tokens, reduced
    like the RL loss (per-sample masked mean, or per token under --calculate-per-token-loss) and scaled by
    1/normalizer. Its metric sum is reported as pg_loss (the other RL metrics are 0)."""
    if normalizer <= 0:
        raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
    mask = loss_mask.to(torch.float32)
    nll = -log_probs.float()
    total = (nll * mask).sum() if per_token else \
        ppo_utils.sample_mean_sum(nll, [int(n) for n in lengths], mask, denominators)
    metrics = {k: 0.0 for k in keys}
    metrics["pg_loss"] = float(total.detach())
    return total / normalizer, metrics
