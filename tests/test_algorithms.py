"""RL formulas against hand-computed examples (the expected numbers are worked out here by hand,
written as the arithmetic that produces them, never by calling the code under test)."""

import math

import pytest
import torch

from slime.backends.megatron.loss import LossConfig, rl_loss
from slime.utils import ppo_utils

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=tol, rtol=0)


# --- KL -----------------------------------------------------------------------------------
def test_kl_estimators_hand_example():
    lp, ref = T([-1.0, -2.0]), T([-1.5, -1.0])  # log r = 0.5, -1.0
    close(ppo_utils.approx_kl(lp, ref, "k1"), [0.5, -1.0])
    close(ppo_utils.approx_kl(lp, ref, "k2"), [0.125, 0.5])
    # k3 = e^{-log r} - 1 + log r
    close(ppo_utils.approx_kl(lp, ref, "k3"), [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    close(ppo_utils.approx_kl(lp, ref, "k3"), [0.10653066, 0.71828183])


def test_low_var_kl_clamps_and_k3_nonnegative():
    lp, ref = T([-25.0, -1.0]), T([-5.0, -1.0])  # log r = -20: k3 = e^20 - 21, clamped to 10
    close(ppo_utils.approx_kl(lp, ref, "low_var_kl"), [10.0, 0.0])
    assert ppo_utils.approx_kl(lp, ref, "k3")[0] > 1e8
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(101, generator=g), torch.randn(101, generator=g)
    assert (ppo_utils.approx_kl(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown kl type"):
        ppo_utils.approx_kl(a, b, "k4")


# --- advantages ---------------------------------------------------------------------------
def test_grpo_hand_example():
    # group [1, 0]: mean .5, unbiased std sqrt(.5) -> +-0.5/0.70710678
    # group [3, 0, 0] (size 3 below): mean 1, centred [2,-1,-1], var (4+1+1)/2 = 3
    adv = ppo_utils.grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [a, -a, -a, a])
    adv3 = ppo_utils.grpo_advantages(T([3.0, 0.0, 0.0]), 3)
    s = math.sqrt(3.0) + 1e-6
    close(adv3, [2 / s, -1 / s, -1 / s])
    close(ppo_utils.grpo_advantages(T([3.0, 0.0, 0.0]), 3, std_normalization=False), [2.0, -1.0, -1.0])


def test_grpo_equal_rewards_zero_not_nan():
    adv = ppo_utils.grpo_advantages(T([0.7, 0.7, 0.7, 0.7]), 4)
    assert torch.isfinite(adv).all() and (adv == 0).all()
    assert (ppo_utils.grpo_advantages(T([1.0, 2.0]), 1) == 0).all()  # a group of one has no baseline
    with pytest.raises(ValueError, match="groups of 3"):
        ppo_utils.grpo_advantages(T([1.0, 2.0]), 3)


def test_compute_advantages_grpo_broadcasts_per_token():
    adv = ppo_utils.compute_advantages("gspo", T([1.0, 0.0]), [2, 3], torch.ones(5), 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [a, a, -a, -a, -a])


def test_reinforce_plus_plus_hand_example():
    # sample 0 (reward 1, kl .1 .2), sample 1 (reward 0, kl .3), kl_coef .5, gamma 1
    # token rewards: [-.05, -.1 + 1] and [-.15]; returns [.85, .9] and [-.15]
    ret = ppo_utils.reinforce_plus_plus_returns(T([1.0, 0.0]), T([0.1, 0.2, 0.3]), [2, 1], 0.5, 1.0)
    close(ret, [0.85, 0.9, -0.15])
    # gamma .5: first return = -.05 + .5 * .9 = .4
    close(ppo_utils.reinforce_plus_plus_returns(T([1.0, 0.0]), T([0.1, 0.2, 0.3]), [2, 1], 0.5, 0.5), [0.4, 0.9, -0.15])
    # whitened: mean 1.6/3, population variance of the deviations
    mean = 1.6 / 3
    dev = [0.85 - mean, 0.9 - mean, -0.15 - mean]
    std = math.sqrt(sum(d * d for d in dev) / 3 + 1e-8)
    adv = ppo_utils.compute_advantages("reinforce_plus_plus", T([1.0, 0.0]), [2, 1], torch.ones(3), 1,
                                       kl=T([0.1, 0.2, 0.3]), kl_coef=0.5)
    close(adv, [d / std for d in dev])
    close(adv, [0.65478, 0.75817, -1.41296], tol=1e-4)


def test_reinforce_plus_plus_baseline_hand_example():
    # group means .5 and .5 -> baselines [.5, -.5, 0, 0]; minus kl_coef*kl -> [.3, -.5, 0, 0]
    # whitening: mean -.05, deviations [.35, -.45, .05, .05], variance .33 / 4
    adv = ppo_utils.compute_advantages("reinforce_plus_plus_baseline", T([1.0, 0.0, 0.5, 0.5]), [1, 1, 1, 1],
                                       torch.ones(4), 2, kl=T([0.2, 0.0, 0.0, 0.0]), kl_coef=1.0)
    std = math.sqrt(0.33 / 4 + 1e-8)
    close(adv, [0.35 / std, -0.45 / std, 0.05 / std, 0.05 / std])


def test_whiten_ignores_masked_tokens():
    out = ppo_utils.masked_whiten(T([1.0, 3.0, 100.0]), T([1.0, 1.0, 0.0]))
    close(out, [-1.0, 1.0, 0.0], tol=1e-5)  # mean 2, population std 1 over the two kept tokens


# --- policy loss --------------------------------------------------------------------------
def test_ppo_clip_hand_example():
    ratio = T([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = T([1.0, 1.0, -1.0, -1.0, 1.0])
    loss, clip = ppo_utils.policy_loss(ratio.log(), adv, eps_clip=0.2, eps_clip_high=0.28)
    # A=+1,r=1.5: max(-1.5, -1.28) = -1.28 (clipped) | A=+1,r=.5: max(-.5, -.8) = -.5
    # A=-1,r=1.5: max(1.5, 1.28) = 1.5             | A=-1,r=.5: max(.5, .8) = .8 (clipped)
    # A=+1,r=1.1: inside [0.8, 1.28] -> -1.1
    close(loss, [-1.28, -0.5, 1.5, 0.8, -1.1])
    close(clip, [1.0, 0.0, 0.0, 1.0, 0.0])


def test_dual_clip_hand_example():
    ratio = T([5.0, 1.5, 5.0])
    adv = T([-1.0, -1.0, 2.0])
    loss, clip = ppo_utils.policy_loss(ratio.log(), adv, 0.2, 0.2, eps_clip_c=3.0)
    # A=-1, r=5: PPO gives max(5, 1.2) = 5, dual clip caps at -A*c = 3
    # A=-1, r=1.5: 1.5 < 3 stays; A=+2, r=5: max(-10, -2.4) = -2.4 (dual clip only for A<0)
    close(loss, [3.0, 1.5, -2.4])
    close(clip, [1.0, 0.0, 1.0])


def test_gspo_ratio_value_and_gradient():
    lp = T([-1.0, -2.0, -0.5], dtype=torch.float64).requires_grad_()
    old = T([-1.2, -1.6, -0.5], dtype=torch.float64)
    mask = T([1.0, 1.0, 1.0], dtype=torch.float64)
    lr = ppo_utils.gspo_log_ratio(lp, old, [2, 1], mask)
    # sequence 0: mean(.2, -.4) = -.1 on both tokens; sequence 1: 0
    close(lr, [-0.1, -0.1, 0.0])
    lr.sum().backward()
    close(lp.grad, [1.0, 1.0, 1.0])  # each token's d log pi, not the mean's
    masked = ppo_utils.gspo_log_ratio(lp.detach(), old, [2, 1], T([1.0, 0.0, 1.0], dtype=torch.float64))
    close(masked, [0.2, 0.2, 0.0])  # masked tokens do not enter the sequence mean


def test_tis_hand_example():
    w = ppo_utils.tis_weights(T([-1.0, -1.0, -1.0]), T([-1.5, -0.2, -1.0]), clip=1.5, clip_low=0.5)
    # exp(.5) = 1.6487 -> 1.5; exp(-.8) = .4493 -> .5; exp(0) = 1
    close(w, [1.5, 0.5, 1.0])


# --- combined objective -------------------------------------------------------------------
def test_rl_loss_combined_hand_example():
    # two samples: lengths [2, 1]; old = actor (ratio 1, no clipping); pg per token = -A
    lp = T([-1.0, -2.0, -0.5]).requires_grad_()
    old = lp.detach().clone()
    ref = T([-1.5, -2.0, -0.5])  # k1 kl per token [.5, 0, 0]
    adv = T([1.0, 1.0, -2.0])
    ent = T([0.4, 0.2, 0.9])
    mask = T([1.0, 1.0, 1.0])
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    loss, m = rl_loss(cfg, lp, ent, old, adv, mask, [2, 1], normalizer=2, ref_log_probs=ref)
    # sample means: pg [-1, 2] -> sum 1; entropy [.3, .9] -> 1.2; kl [.25, 0] -> .25
    expected = (1.0 - 0.01 * 1.2 + 0.1 * 0.25) / 2
    close(loss.detach(), expected)
    close(m["pg_loss"], 1.0), close(m["entropy"], 1.2), close(m["kl"], 0.25), close(m["clip_frac"], 0.0)
    loss.backward()
    # d/dlp of pg (ratio=1): -A / len per token; kl k1: +coef / len
    close(lp.grad, [(-1 / 2 + 0.1 / 2) / 2, (-1 / 2 + 0.1 / 2) / 2, (2.0 + 0.1) / 2])


def test_rl_loss_per_token_and_tis():
    lp = T([-1.0, -2.0, -0.5])
    rollout = T([-1.5, -2.0, -0.1])  # tis = [e^.5 -> clip 1.5, 1, e^-.4]
    adv = T([1.0, 1.0, -2.0])
    mask = T([1.0, 0.0, 1.0])
    cfg = LossConfig(use_tis=True, tis_clip=1.5, per_token_loss=True)
    loss, m = rl_loss(cfg, lp, torch.zeros(3), lp, adv, mask, [2, 1], normalizer=2, rollout_log_probs=rollout)
    # per-token sum over kept tokens: -1 * 1.5 + 2 * e^-.4
    close(loss, (-1.5 + 2 * math.exp(-0.4)) / 2)
    close(m["tis"], 1.5 + math.exp(-0.4))
    with pytest.raises(ValueError, match="rollout log-probs"):
        rl_loss(cfg, lp, torch.zeros(3), lp, adv, mask, [2, 1], normalizer=2)


# --- upstream's loss hooks (--custom-tis-function-path, --custom-pg-loss-reducer-function-path) ---------------

def _tis_x3_reject_first(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                         response_lengths):
    """A TIS/RS function: weight 3 everywhere, reject the first token of sample 0."""
    assert [t.numel() for t in train_log_probs] == response_lengths == [2, 1] and total_lengths == [5, 3]
    assert [t.numel() for t in rollout_log_probs] == [2, 1] and args == "ARGS"
    masks = [m.clone() for m in loss_masks]
    masks[0][0] = 0.0
    return pg_loss * 3.0, masks, {"tis": torch.full_like(pg_loss, 3.0)}


def test_custom_tis_function_reweights_and_rejects_tokens():
    from slime.backends.megatron.loss import LossHooks

    lp = T([-1.0, -2.0, -0.5], requires_grad=True)
    adv, mask = T([1.0, 2.0, -4.0]), T([1.0, 1.0, 1.0])
    cfg = LossConfig(use_tis=True)
    hooks = LossHooks(args="ARGS", tis_function=_tis_x3_reject_first)
    loss, m = rl_loss(cfg, lp, torch.zeros(3), lp.detach(), adv, mask, [2, 1], normalizer=2,
                      rollout_log_probs=lp.detach(), hooks=hooks, total_lengths=[5, 3])
    # ratio 1, pg = -A = [-1, -2, 4], x3, token 0 rejected (numerator only): (-6 / 2 + 12 / 1) / 2
    close(loss, (-6 / 2 + 12) / 2)
    close(m["tis"], 3 + 3)  # over the tokens before rejection: per-sample means 3 and 3
    built_in, _ = rl_loss(cfg, lp, torch.zeros(3), lp.detach(), adv, mask, [2, 1], normalizer=2,
                          rollout_log_probs=lp.detach())
    close(built_in, ((-1 - 2) / 2 + 4) / 2)
    loss.backward()
    close(lp.grad, [0.0, 3 * -2 / 2 / 2, 3 * 4 / 2])  # d(-A ratio)/dlp = -A; rejected token: no gradient
    with pytest.raises(ValueError, match="loss masks of 2 tokens"):
        rl_loss(cfg, lp, torch.zeros(3), lp.detach(), adv, mask, [2, 1], normalizer=2, rollout_log_probs=lp.detach(),
                hooks=LossHooks(tis_function=lambda **kw: (kw["pg_loss"], [T([1.0, 1.0])], {})), total_lengths=[5, 3])


def test_custom_pg_loss_reducer_replaces_the_policy_term_only():
    from slime.backends.megatron.loss import LossHooks

    seen = {}

    def dr_grpo(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
        seen.update(total=total_lengths, response=response_lengths, per_token=calculate_per_token_loss,
                    masks=[m.tolist() for m in loss_masks])
        return lambda x: (x * torch.cat(loss_masks)).sum() / 4.0  # a constant denominator

    lp = T([-1.0, -2.0, -0.5])
    adv, mask, ent = T([1.0, 2.0, -4.0]), T([1.0, 0.0, 1.0]), T([0.5, 0.5, 2.0])
    cfg = LossConfig(entropy_coef=0.1)
    loss, m = rl_loss(cfg, lp, ent, lp, adv, mask, [2, 1], normalizer=1,
                      hooks=LossHooks(pg_loss_reducer=dr_grpo), total_lengths=[5, 3])
    assert seen == {"total": [5, 3], "response": [2, 1], "per_token": False, "masks": [[1.0, 0.0], [1.0]]}
    # pg: (-1 + 4) / 4; the entropy keeps the per-sample mean: 0.5 / 1 + 2 / 1
    close(loss, (-1 + 4) / 4 - 0.1 * (0.5 + 2.0))
    close(m["pg_loss"], 0.75)
    with pytest.raises(ValueError, match="total_lengths"):
        rl_loss(cfg, lp, ent, lp, adv, mask, [2, 1], normalizer=1, hooks=LossHooks(pg_loss_reducer=dr_grpo))


def test_loss_hooks_load_from_their_flags():
    from types import SimpleNamespace

    from slime.backends.megatron.loss import LossHooks

    args = SimpleNamespace(custom_tis_function_path="slime.utils.ppo_utils.tis_weights",
                           custom_pg_loss_reducer_function_path=None)
    hooks = LossHooks.from_args(args)
    assert hooks.tis_function is ppo_utils.tis_weights and hooks.pg_loss_reducer is None and hooks.args is args
