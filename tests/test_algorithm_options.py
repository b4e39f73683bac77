"""Upstream's algorithm and run flags not covered elsewhere: --use-opsm / --opsm-delta (off-policy sequence
masking), --custom-advantage-function-path, --log-probs-max-tokens-per-gpu, --train-env-vars, --ref-ckpt-step and
--opd-teacher-ckpt-step; each against a reference computed here."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron.loss import LossConfig, rl_loss
from slime.config.arguments import build_parser

CALLS: list[dict] = []


def _loss_inputs():
    torch.manual_seed(0)
    lengths = [3, 4, 2, 5]
    n = sum(lengths)
    old = -torch.rand(n, dtype=torch.float64) * 2
    # sample 0: negative advantage, far off-policy (old - new = 0.3 per token) -> masked
    # sample 1: negative advantage, on-policy within delta -> kept; sample 2: positive advantage, off-policy -> kept
    # sample 3: negative advantage, off-policy only on its loss-masked tokens -> kept (the mean is over the mask)
    shift = torch.cat([torch.full((3,), 0.3), torch.full((4,), 5e-5), torch.full((2,), 0.4),
                       torch.tensor([0.0, 0.0, 0.0, 2.0, 2.0])]).double()
    new = (old - shift).requires_grad_(True)
    adv = torch.cat([torch.full((3,), -1.0), torch.full((4,), -0.5), torch.full((2,), 2.0), torch.full((5,), -1.0)]).double()
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.float64)
    return lengths, old, new, adv, mask


def _reference_pg(lengths, old, new, adv, mask, drop: set[int], eps=0.2):
    """float64: clipped policy loss, per-sample masked mean, summed over samples; `drop` samples contribute 0."""
    ratio = torch.exp(new - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    total = torch.zeros((), dtype=torch.float64)
    for i, (p, m) in enumerate(zip(pg.split(lengths), mask.split(lengths))):
        if i not in drop:
            total = total + (p * m).sum() / m.sum().clamp_min(1)
    return total


def test_opsm_drops_exactly_the_off_policy_negative_samples():
    lengths, old, new, adv, mask = _loss_inputs()
    cfg = LossConfig(use_opsm=True, opsm_delta=1e-4)
    loss, m = rl_loss(cfg, new, torch.zeros_like(new), old, adv, mask, lengths, normalizer=4.0)
    ref = _reference_pg(lengths, old, new.detach(), adv, mask, drop={0}) / 4.0
    torch.testing.assert_close(loss.detach().double(), ref, rtol=1e-5, atol=1e-7)  # float32 loss
    assert m["opsm_clipfrac"] == pytest.approx(1.0)  # sample 0's every token
    loss.backward()
    grads = new.grad.split(lengths)
    assert float(grads[0].abs().max()) == 0.0 and float(grads[1].abs().max()) > 0 and float(grads[2].abs().max()) > 0
    plain, m_plain = rl_loss(LossConfig(), new.detach(), torch.zeros_like(new), old, adv, mask, lengths, 4.0)
    torch.testing.assert_close(plain.double(), _reference_pg(lengths, old, new.detach(), adv, mask, drop=set()) / 4.0,
                               rtol=1e-5, atol=1e-7)
    assert "opsm_clipfrac" not in m_plain
    # a looser bound keeps sample 0 too
    loose, m_loose = rl_loss(LossConfig(use_opsm=True, opsm_delta=0.5), new.detach(), torch.zeros_like(new), old,
                             adv, mask, lengths, 4.0)
    torch.testing.assert_close(loose, plain)
    assert m_loose["opsm_clipfrac"] == 0.0


def record_advantages(args, rollout_data):
    """A custom advantage function (upstream's contract): advantage = reward - 0.1 * kl per token."""
    CALLS.append({k: v for k, v in rollout_data.items()})
    rollout_data["advantages"] = [torch.full((n,), r) - 0.1 * kl
                                  for r, n, kl in zip(rollout_data["rewards"], rollout_data["response_lengths"],
                                                      rollout_data["kl"])]
    rollout_data["returns"] = rollout_data["advantages"]


def wrong_length_advantages(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n + 1) for n in rollout_data["response_lengths"]]


def _batch():
    from slime.backends.megatron.data import RolloutBatch

    lengths = [2, 3, 1, 2]
    return RolloutBatch(tokens=[[5] * (4 + n) for n in lengths], response_lengths=lengths,
                        loss_masks=[[1] * n for n in lengths], rewards=[1.0, 0.0, 0.5, 0.25],
                        old_log_probs=[-torch.rand(n) for n in lengths], ref_log_probs=[-torch.rand(n) for n in lengths])


def test_custom_advantage_function_replaces_the_estimator():
    from slime.backends.megatron.rollout_data import share_advantages
    from slime.utils.ppo_utils import approx_kl

    args = build_parser().parse_args(["--custom-advantage-function-path", f"{__name__}.record_advantages",
                                      "--n-samples-per-prompt", "2", "--kl-coef", "0.1"])
    batch = _batch()
    CALLS.clear()
    share_advantages(args, batch, [1, 2])  # this rank's share: samples 1 and 2
    (data,) = CALLS
    assert data["response_lengths"] == [3, 1] and data["total_lengths"] == [7, 5]
    # grpo's group-normalized rewards: groups (1, 0) and (0.5, 0.25)
    assert data["rewards"] == pytest.approx([-1 / 2 ** 0.5, 1 / 2 ** 0.5], rel=1e-5)
    for j, i in enumerate([1, 2]):
        kl = approx_kl(batch.old_log_probs[i], batch.ref_log_probs[i], args.kl_loss_type)
        torch.testing.assert_close(data["kl"][j], kl)
        torch.testing.assert_close(torch.as_tensor(batch.advantages[i]), data["rewards"][j] - 0.1 * kl)
    assert batch.advantages[0] is None and batch.advantages[3] is None
    bad = build_parser().parse_args(["--custom-advantage-function-path", f"{__name__}.wrong_length_advantages"])
    with pytest.raises(ValueError, match="sample 0's advantages have 4 values for 3 response tokens"):
        share_advantages(bad, _batch(), [1, 2])


def test_train_env_vars_reach_the_trainer_ranks(monkeypatch):
    import ray

    from slime.ray import actor_group

    seen = []

    class Slots:
        def __len__(self):
            return 2

        def actor_options(self, rank, extra_env=None):
            env = {"DEVICE_SLOT": str(rank), **(extra_env or {})}  # the accelerator's, then the user's
            seen.append(env)
            return {"runtime_env": {"env_vars": env}}

    class Actor:
        @classmethod
        def options(cls, **kw):
            return cls

        @classmethod
        def remote(cls, *a):
            return SimpleNamespace(get_master_addr_port=SimpleNamespace(remote=lambda: ("h", 1)),
                                   __ray_call__=SimpleNamespace(remote=lambda fn: (7, True)))  # (pid, host memory)

    monkeypatch.setattr(ray, "get", lambda x: x)
    args = build_parser().parse_args(["--train-env-vars", '{"PYTORCH_ALLOC_CONF": "expandable_segments:True", "N": 3}'])
    actor_group.RayTrainGroup(args, Slots(), Actor)
    assert seen == [{"DEVICE_SLOT": "0", "PYTORCH_ALLOC_CONF": "expandable_segments:True", "N": "3"},
                    {"DEVICE_SLOT": "1", "PYTORCH_ALLOC_CONF": "expandable_segments:True", "N": "3"}]


def test_train_env_vars_must_be_a_json_object(capsys):
    for bad in ("[1, 2]", "{nope"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--train-env-vars", bad])
        err = capsys.readouterr().err
        assert "--train-env-vars" in err and len(err.strip().splitlines()) == 1


def test_ckpt_steps_pick_an_iteration(tmp_path):
    from slime.config.arguments import ArgumentError, _pick_checkpoint_step

    root = tmp_path / "save"
    for it in (3, 5):
        (root / f"iter_{it:07d}").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    args = SimpleNamespace(ref_load=str(root), ref_ckpt_step=3, opd_teacher_load=None, opd_teacher_ckpt_step=None,
                           dry_run=False)
    _pick_checkpoint_step(args, "ref_load", "ref_ckpt_step")
    assert args.ref_load == os.path.join(str(root), "iter_0000003")
    _pick_checkpoint_step(args, "opd_teacher_load", "opd_teacher_ckpt_step")  # unset: nothing changes
    args.ref_load, args.ref_ckpt_step = str(root), 4
    with pytest.raises(ArgumentError, match="--ref-ckpt-step 4: .*iter_0000004 does not exist .*iter_0000003, iter_0000005"):
        _pick_checkpoint_step(args, "ref_load", "ref_ckpt_step")
    args.opd_teacher_ckpt_step = 3
    with pytest.raises(ArgumentError, match="--opd-teacher-ckpt-step needs --opd-teacher-load"):
        _pick_checkpoint_step(args, "opd_teacher_load", "opd_teacher_ckpt_step")


def test_mismatch_metrics_are_reported_not_applied():
    lengths, old, new, adv, mask = _loss_inputs()
    rollout = old + torch.linspace(-1.0, 1.0, old.numel(), dtype=torch.float64)
    base, m0 = rl_loss(LossConfig(), new.detach(), torch.zeros_like(new), old, adv, mask, lengths, 4.0,
                       rollout_log_probs=rollout)
    cfg = LossConfig(get_mismatch_metrics=True, tis_clip=2.0, tis_clip_low=0.5)
    loss, m = rl_loss(cfg, new.detach(), torch.zeros_like(new), old, adv, mask, lengths, 4.0, rollout_log_probs=rollout)
    torch.testing.assert_close(loss, base)  # the loss is not weighted

    def per_sample_sum(v):  # float64: per-sample masked mean, summed over samples
        return sum(float((x * k).sum() / k.sum().clamp_min(1)) for x, k in zip(v.split(lengths), mask.split(lengths)))

    ratio = torch.exp(old - rollout)
    assert m["tis"] == pytest.approx(per_sample_sum(ratio), rel=1e-5)
    assert m["tis_clipfrac"] == pytest.approx(per_sample_sum(((ratio < 0.5) | (ratio > 2.0)).double()), rel=1e-6)
    assert m["tis_abs"] == pytest.approx(per_sample_sum((ratio - 1).abs()), rel=1e-5)
    assert m["ois"] == pytest.approx(per_sample_sum(torch.exp(new.detach() - old)), rel=1e-5)
    assert 0 < m["tis_clipfrac"] < len(lengths) and m0["tis"] == 0.0
    with pytest.raises(ValueError, match="--get-mismatch-metrics needs rollout log-probs"):
        rl_loss(cfg, new.detach(), torch.zeros_like(new), old, adv, mask, lengths, 4.0)


@pytest.mark.parametrize("seed", range(6))
def test_flops_balance_partitions_near_the_optimum(seed):
    import itertools
    import random

    from slime.backends.megatron import flops_balance as F

    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(4, 8))]
    k = rng.randint(2, 3)
    costs = F.workloads(lengths, coeff=50.0)
    bins = F.karmarkar_karp(costs, k)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths))) and len(bins) == k and all(bins)
    best = min(max(sum(costs[i] for i, a in enumerate(assign) if a == j) for j in range(k))
               for assign in itertools.product(range(k), repeat=len(lengths)) if len(set(assign)) == k)
    got = max(sum(costs[i] for i in b) for b in bins)
    assert got <= 4 / 3 * best + 1e-9, (got, best)


def test_flops_balance_counts_and_coefficient():
    from slime.backends.megatron import flops_balance as F

    assert F.micro_batch_count([10, 20, 30], 25) == 3 and F.micro_batch_count([10, 20, 30], 1000) == 1
    assert F.flops_balanced_micro_batches([5, 6], 4, 1.0) == [[0], [1]]
    dense = SimpleNamespace(hidden_size=64, intermediate_size=256, num_experts_per_tok=0, moe_intermediate_size=0)
    moe = SimpleNamespace(hidden_size=64, intermediate_size=256, num_experts_per_tok=2, moe_intermediate_size=32,
                          n_shared_experts=1)
    assert F.flops_coefficient(dense) == 4 * 64 + 3 * 256 and F.flops_coefficient(moe) == 4 * 64 + 3 * 96
    with pytest.raises(ValueError, match="cannot split 2 samples into 3"):
        F.karmarkar_karp([1.0, 2.0], 3)
