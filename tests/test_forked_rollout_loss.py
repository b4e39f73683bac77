"""A rollout of several samples (an agent session that forked) reduces to ONE token-weighted mean over all its
samples' loss tokens, the step's loss averaging those over its --global-batch-size rollouts: upstream's reducer
(slime/ray/rollout.py's rollout_mask_sums as each sample's denominator, megatron_utils/cp_utils.py
get_sum_of_sample_mean, the loss times micro-batches / rollouts in the step). Checked against a float64 computation
of that formula for the policy loss (PPO clip, entropy, k3 KL), SFT, MTP and the critic's value loss, with odd
rollout sizes, rollouts split across micro-batches and across two data-parallel ranks, a rollout without loss
tokens; with one sample per rollout the reduction is bit-identical to the per-sample mean it always was."""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.megatron import data as D
from slime.backends.megatron.loss import LossConfig, mtp_loss, rl_loss, sft_loss
from slime.utils import ppo_utils

EPS = 0.2
ENTROPY_COEF, KL_COEF = 0.01, 0.3
# rollouts of 2, 3, 1 and 1 samples, interleaved; rollout 5's only sample has no loss tokens
ROLLOUT_IDS = [0, 1, 1, 2, 0, 1, 5]
# packing that splits rollouts 0 and 1 over micro-batches
MICRO_BATCHES = [[0, 3, 5], [1, 6], [2, 4]]


def _batch(rollout_ids, seed=0) -> D.RolloutBatch:
    rng = random.Random(seed)
    tokens, lengths, masks = [], [], []
    for k in range(len(rollout_ids)):
        n = rng.randint(2, 7)
        tokens.append([rng.randrange(3, 100) for _ in range(n + rng.randint(1, 4))])
        lengths.append(n)
        masks.append([0] * n if rollout_ids[k] == 5 else [int(rng.random() < 0.7) for _ in range(n)])
    return D.RolloutBatch(tokens=tokens, response_lengths=lengths, rewards=[0.0] * len(tokens), loss_masks=masks,
                          rollout_ids=list(rollout_ids))


def _per_token_inputs(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = sum(batch.response_lengths)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    return {"log_probs": old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8,
            "old": old, "ref": old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.5,
            "adv": torch.randn(n, generator=g, dtype=torch.float64),
            "entropy": torch.rand(n, generator=g, dtype=torch.float64) * 3}


def _upstream_step_loss(batch, step, per_token: torch.Tensor) -> torch.Tensor:
    """float64: sum over the step's samples of (masked token sum / max(its rollout's loss-mask total, 1)), over the
    step's rollout count."""
    totals: dict[int, int] = {}
    for i in step:
        totals[batch.rollout_ids[i]] = totals.get(batch.rollout_ids[i], 0) + sum(batch.loss_masks[i])
    parts = per_token.split(batch.response_lengths)
    out = sum((parts[i] * torch.tensor(batch.loss_masks[i], dtype=torch.float64)).sum()
              / max(totals[batch.rollout_ids[i]], 1) for i in step)
    return out / len(totals)


def _policy_terms(x) -> torch.Tensor:
    ratio = torch.exp(x["log_probs"] - x["old"])
    pg = torch.maximum(-x["adv"] * ratio, -x["adv"] * ratio.clamp(1 - EPS, 1 + EPS))
    log_ratio = x["log_probs"] - x["ref"]
    return pg - ENTROPY_COEF * x["entropy"] + KL_COEF * (torch.exp(-log_ratio) - 1 + log_ratio)


def _cat(batch, flat, indices):
    parts = flat.split(batch.response_lengths)
    return torch.cat([parts[i] for i in indices])


def _trainer_step(batch, step, dp_size, loss_of_micro_batch):
    """Each data-parallel rank's micro-batches over its shard, its losses summed, the ranks' losses averaged (the
    gradient all-reduce): the loss whose gradient the optimizer applies."""
    denominators = D.rollout_denominators(batch)
    total = 0
    for rank in range(dp_size):
        shard = D.dp_shard(step, rank, dp_size)
        normalizer = D.sample_mean_normalizer(batch, step, shard, dp_size)
        mbs = [[shard[k] for k in mb if k < len(shard)] for mb in MICRO_BATCHES] if dp_size == 1 else \
            [shard[:1], shard[1:]]
        for mb in mbs:
            mask = torch.cat([torch.tensor(batch.loss_masks[i]) for i in mb])
            total = total + loss_of_micro_batch(mb, mask, [denominators[i] for i in mb], normalizer)
    return total / dp_size


def _leaves(x):
    return {k: v.float().clone().requires_grad_(k in ("log_probs", "entropy")) for k, v in x.items()}


@pytest.mark.parametrize("dp_size", [1, 2])
def test_policy_loss_of_forked_rollouts_is_upstreams_per_rollout_mean(dp_size):
    ids = ROLLOUT_IDS if dp_size == 1 else ROLLOUT_IDS[:-1]  # 6 samples: 3 per rank, rollout 1 over both ranks
    batch = _batch(ids)
    step = list(range(len(ids)))
    x64 = _per_token_inputs(batch)
    ref_in = {k: v.clone().requires_grad_(k in ("log_probs", "entropy")) for k, v in x64.items()}
    want = _upstream_step_loss(batch, step, _policy_terms(ref_in))
    want.backward()
    cfg = LossConfig(eps_clip=EPS, eps_clip_high=EPS, use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="k3",
                     entropy_coef=ENTROPY_COEF)
    x = _leaves(x64)

    def loss_of(mb, mask, denominators, normalizer):
        loss, _ = rl_loss(cfg, _cat(batch, x["log_probs"], mb), _cat(batch, x["entropy"], mb),
                          _cat(batch, x["old"], mb), _cat(batch, x["adv"], mb), mask,
                          [batch.response_lengths[i] for i in mb], normalizer,
                          ref_log_probs=_cat(batch, x["ref"], mb), denominators=denominators)
        return loss

    got = _trainer_step(batch, step, dp_size, loss_of)
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(x[k].grad.double(), ref_in[k].grad, rtol=1e-5, atol=1e-7)
    # the per-sample mean it replaces differs here: the check can fail
    per_sample = sum((t * torch.tensor(m, dtype=torch.float64)).sum() / max(sum(m), 1) for t, m in
                     zip(_policy_terms(x64).split(batch.response_lengths), batch.loss_masks)) / len(step)
    assert abs(float(per_sample) - float(want)) > 1e-3


@pytest.mark.parametrize("kind", ["sft", "mtp", "value"])
def test_sft_mtp_and_value_losses_of_forked_rollouts_are_upstreams_per_rollout_mean(kind):
    batch = _batch(ROLLOUT_IDS, seed=2)
    step = list(range(len(batch)))
    x64 = _per_token_inputs(batch, seed=3)
    returns, old_values = x64["adv"], x64["old"]
    values64 = x64["log_probs"].clone().requires_grad_(True)
    if kind == "value":  # upstream's clipped value loss with value_clip 0.2
        clipped = old_values + (values64 - old_values).clamp(-0.2, 0.2)
        terms = torch.maximum((clipped - returns).square(), (values64 - returns).square())
    else:  # negative log-likelihood (MTP: one depth, scale 0.5)
        terms = -values64 * (0.5 if kind == "mtp" else 1.0)
    want = _upstream_step_loss(batch, step, terms)
    want.backward()
    values = values64.detach().float().requires_grad_(True)

    def loss_of(mb, mask, denominators, normalizer):
        lengths = [batch.response_lengths[i] for i in mb]
        v = _cat(batch, values, mb)
        if kind == "sft":
            return sft_loss(v, mask, lengths, normalizer, False, ("pg_loss",), denominators)[0]
        if kind == "mtp":
            return mtp_loss([v], [mask.float()], lengths, normalizer, 0.5, False, denominators)[0]
        per_token, _ = ppo_utils.value_loss(v, _cat(batch, old_values.float(), mb), _cat(batch, returns.float(), mb),
                                            0.2)
        return ppo_utils.sample_mean_sum(per_token, lengths, mask.float(), denominators) / normalizer

    got = _trainer_step(batch, step, 1, loss_of)
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(values.grad.double(), values64.grad, rtol=1e-5, atol=1e-7)


def test_one_sample_per_rollout_is_bit_identical_to_the_per_sample_mean():
    for ids in (None, [4, 0, 7, 1, 2, 3]):
        batch = _batch([0, 1, 2, 3, 4, 6], seed=4)
        batch.rollout_ids = ids
        assert D.rollout_denominators(batch) == [None] * 6 and D.rollout_shares(batch) == [1.0] * 6
        for shard, dp in (([0, 1, 2, 3, 4, 5], 1), ([1, 3, 5], 2)):
            assert D.sample_mean_normalizer(batch, list(range(6)), shard, dp) == float(len(shard))
    x = {k: v.float() for k, v in _per_token_inputs(batch, seed=5).items()}
    mask = torch.cat([torch.tensor(m) for m in batch.loss_masks])
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=KL_COEF, entropy_coef=ENTROPY_COEF)
    runs = [rl_loss(cfg, x["log_probs"], x["entropy"], x["old"], x["adv"], mask, batch.response_lengths, 6.0,
                    ref_log_probs=x["ref"], denominators=d) for d in (None, [None] * 6)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_denominators_and_shares_of_forked_rollouts():
    batch = _batch(ROLLOUT_IDS)
    masks = batch.loss_masks
    r0, r1 = sum(masks[0]) + sum(masks[4]), sum(masks[1]) + sum(masks[2]) + sum(masks[5])
    assert D.rollout_denominators(batch) == [r0, r1, r1, None, r0, r1, None]
    assert sum(D.rollout_shares(batch)) == pytest.approx(4.0)
    assert D.sample_mean_normalizer(batch, list(range(7)), list(range(7)), 1) == 4.0
    with pytest.raises(ValueError, match="^2 denominators for 3 samples$"):
        ppo_utils.sample_mean_sum(torch.ones(3), [1, 1, 1], torch.ones(3), [1.0, None])
