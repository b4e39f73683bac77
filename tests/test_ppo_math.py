"""PPO-with-critic and on-policy-distillation formulas (slime.utils.ppo_utils) against float64 references
written here from the formulas: GAE, PPO token rewards, the clipped value loss, the OPD advantage term and
its gradient through the policy loss."""

from __future__ import annotations

import pytest
import torch

from slime.utils import ppo_utils


def _gae_reference(rewards: list[float], values: list[float], gamma: float, lambd: float):
    """A_t = sum_{k >= 0} (gamma * lambd)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0; R = A + V.
    An explicit double sum in float64 (no recursion)."""
    n = len(rewards)
    v = values + [0.0]
    delta = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(n)]
    adv = [sum((gamma * lambd) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
    return adv, [a + b for a, b in zip(adv, values)]


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_equals_the_float64_formula(gamma, lambd):
    g = torch.Generator().manual_seed(7)
    lengths = [1, 2, 7, 13, 4]  # odd lengths, a one-token response
    rewards = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    values = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    adv, ret = ppo_utils.gae(rewards.float(), values.float(), lengths, gamma, lambd)
    at = 0
    for n in lengths:
        ref_a, ref_r = _gae_reference(rewards[at:at + n].tolist(), values[at:at + n].tolist(), gamma, lambd)
        torch.testing.assert_close(adv[at:at + n].double(), torch.tensor(ref_a, dtype=torch.float64), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ret[at:at + n].double(), torch.tensor(ref_r, dtype=torch.float64), atol=2e-5, rtol=1e-5)
        at += n


def test_ppo_advantages_are_gae_of_kl_shaped_rewards_and_depend_on_the_values():
    """--advantage-estimator ppo: token rewards -kl_coef * kl with the reward on the last token, GAE against the
    critic's values; masked whitening with --normalize-advantages. Different values give different advantages;
    GRPO's ignore them."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 1, 6, 5]
    n = sum(lengths)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    kl = torch.randn(n, generator=g) * 0.1
    values = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    adv = ppo_utils.compute_advantages("ppo", rewards, lengths, mask, 2, kl=kl, kl_coef=0.05, gamma=0.97,
                                       values=values, lambd=0.9)
    at, ref = 0, []
    for r, m in zip(rewards.tolist(), lengths):
        token = [-0.05 * float(x) for x in kl[at:at + m].double()]
        token[-1] += r
        ref += _gae_reference(token, values[at:at + m].double().tolist(), 0.97, 0.9)[0]
        at += m
    ref = torch.tensor(ref, dtype=torch.float64)
    torch.testing.assert_close(adv.double(), ref, atol=2e-5, rtol=1e-5)
    whitened = ppo_utils.compute_advantages("ppo", rewards, lengths, mask, 2, kl=kl, kl_coef=0.05, gamma=0.97,
                                            values=values, lambd=0.9, normalize=True)
    kept = ref[mask.bool()]
    ref_w = (ref - kept.mean()) / torch.sqrt(kept.var(unbiased=False) + 1e-8) * mask.double()
    torch.testing.assert_close(whitened.double(), ref_w, atol=1e-5, rtol=1e-5)
    other = ppo_utils.compute_advantages("ppo", rewards, lengths, mask, 2, kl=kl, kl_coef=0.05, gamma=0.97,
                                         values=values + 0.5, lambd=0.9)
    assert (other - adv).abs().max() > 0.01  # the critic matters
    grpo = ppo_utils.compute_advantages("grpo", rewards, lengths, mask, 2)
    assert (grpo - adv).abs().max() > 0.1
    with pytest.raises(ValueError, match="needs the critic's values"):
        ppo_utils.compute_advantages("ppo", rewards, lengths, mask, 2)


def test_value_loss_equals_the_clipped_float64_formula():
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(17, generator=g, dtype=torch.float64) for _ in range(3))
    loss, clipfrac = ppo_utils.value_loss(v.float(), old.float(), ret.float(), 0.2)
    clipped = old + torch.clamp(v - old, -0.2, 0.2)
    ref = torch.maximum((clipped - ret) ** 2, (v - ret) ** 2)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    assert clipfrac.tolist() == ((v - old).abs() > 0.2).double().tolist()
    assert 0 < clipfrac.sum() < 17  # both branches exercised


def test_opd_term_and_its_gradient_through_the_policy_loss():
    """--use-opd: advantage - opd_kl_coef * (log pi_student - log pi_teacher), before whitening. Through the
    policy loss at ratio 1 the gradient per token is -A / (masked length) / normalizer, so OPD adds
    coef * (student - teacher) / (masked length) / normalizer (float64 reference); teacher == student adds 0."""
    from slime.backends.megatron.loss import LossConfig, rl_loss

    g = torch.Generator().manual_seed(11)
    lengths = [3, 5, 2, 7]
    n = sum(lengths)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = (torch.rand(n, generator=g) > 0.25).float()
    mask[0] = mask[3] = mask[8] = mask[10] = 1.0
    student = -torch.rand(n, generator=g) * 3
    teacher = -torch.rand(n, generator=g) * 3
    coef = 0.7
    base = ppo_utils.compute_advantages("grpo", rewards, lengths, mask, 2)
    opd = ppo_utils.compute_advantages("grpo", rewards, lengths, mask, 2,
                                       opd=ppo_utils.OnPolicyDistillation(student, teacher, coef))
    ref_term = -coef * (student.double() - teacher.double())
    torch.testing.assert_close((opd - base).double(), ref_term, atol=1e-6, rtol=1e-6)
    same = ppo_utils.compute_advantages("grpo", rewards, lengths, mask, 2,
                                        opd=ppo_utils.OnPolicyDistillation(student, student.clone(), coef))
    assert torch.equal(same, base)
    # whitening comes after the OPD term (upstream's order)
    w = ppo_utils.compute_advantages("grpo", rewards, lengths, mask, 2, normalize=True,
                                     opd=ppo_utils.OnPolicyDistillation(student, teacher, coef))
    torch.testing.assert_close(w, ppo_utils.masked_whiten(opd, mask))

    def grad(adv):
        lp = student.clone().requires_grad_(True)
        loss, _ = rl_loss(LossConfig(), lp, torch.zeros(n), student, adv, mask, lengths, normalizer=4.0)
        loss.backward()
        return lp.grad.double()

    diff = grad(opd) - grad(base)
    kept = torch.cat([torch.full((m,), float(s)) for m, s in zip(lengths, [mask[a:a + m].sum() for a, m in
                                                                           zip([0, 3, 8, 10], lengths)])]).double()
    ref_grad = coef * (student.double() - teacher.double()) * mask.double() / kept / 4.0
    assert diff.abs().max() > 1e-3
    torch.testing.assert_close(diff, ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(grad(same), grad(base))
