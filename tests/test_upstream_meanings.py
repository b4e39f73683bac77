"""Flags with upstream slime's meaning: defaults (--kl-loss-type k1, --mtp-loss-scaling-factor 0.2),
--num-steps-per-rollout against --global-batch-size, --colocate's offload, --normalize-advantages, --kl-coef
shaping by --kl-loss-type, --moe-router-dtype, and the one-line warnings for deliberate differences."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _parse(tmp_path: Path, *extra: str):
    from slime.config.arguments import parse_args

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text((ROOT / "scripts/models/configs/qwen3-4B.json").read_text())
    return parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", "2", "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "4", *extra])


def test_defaults_are_upstreams(tmp_path):
    args = _parse(tmp_path)
    assert args.kl_loss_type == "k1" and args.mtp_loss_scaling_factor == 0.2
    assert (args.global_batch_size, args.num_steps_per_rollout) == (16, 1)
    assert args.offload_train is False and args.offload_rollout is False and args.normalize_advantages is False


@pytest.mark.parametrize("extra, want", [
    (["--num-steps-per-rollout", "4"], (4, 4)),
    (["--global-batch-size", "8"], (8, 2)),
    (["--global-batch-size", "8", "--num-steps-per-rollout", "2"], (8, 2)),
])
def test_steps_per_rollout_and_global_batch_agree(tmp_path, extra, want):
    args = _parse(tmp_path, *extra)
    assert (args.global_batch_size, args.num_steps_per_rollout) == want


def test_steps_per_rollout_disagreeing_with_global_batch_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(tmp_path, "--global-batch-size", "8", "--num-steps-per-rollout", "4")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: --global-batch-size 8 disagrees with --num-steps-per-rollout 4 "
                   "(rollout-batch-size*n-samples-per-prompt 16 / 4 = 4); pass one of them"]


@pytest.mark.parametrize("extra, want", [
    (["--colocate"], (True, True)),
    (["--colocate", "--no-offload-train"], (False, True)),
    (["--colocate", "--no-offload-rollout"], (True, False)),
    (["--offload-rollout"], (False, True)),
    (["--offload"], (True, True)),
])
def test_colocate_implies_offload(tmp_path, extra, want):
    args = _parse(tmp_path, *extra)
    assert (args.offload_train, args.offload_rollout) == want


def test_normalize_advantages_whitens_grpo_over_masked_tokens():
    from slime.utils.ppo_utils import compute_advantages

    g = torch.Generator().manual_seed(0)
    rewards, lengths = torch.rand(8, generator=g), [3, 1, 4, 2, 5, 2, 3, 1]
    mask = (torch.rand(sum(lengths), generator=g) > 0.3).float()
    plain = compute_advantages("grpo", rewards, lengths, mask, 4)
    whitened = compute_advantages("grpo", rewards, lengths, mask, 4, normalize=True)
    a, m = plain.double(), mask.double().bool()
    mean, var = a[m].mean(), a[m].var(unbiased=False)
    want = torch.where(m, (a - mean) / torch.sqrt(var + 1e-8), torch.zeros_like(a))
    assert torch.allclose(whitened.double(), want, atol=1e-6)
    assert whitened[m].double().mean().abs() < 1e-6 and (whitened[~m] == 0).all()


@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_kl_coef_shaping_follows_kl_loss_type(kl_type):
    """reinforce_plus_plus_baseline's token advantage is (r - group mean) - kl_coef * KL_type, whitened."""
    from slime.backends.megatron.data import RolloutBatch
    from slime.backends.megatron.rollout_data import share_advantages
    from slime.utils.ppo_utils import masked_whiten

    g = torch.Generator().manual_seed(1)
    lengths = [3, 2, 4, 1]
    old = [-torch.rand(n, generator=g) for n in lengths]
    ref = [-torch.rand(n, generator=g) for n in lengths]
    batch = RolloutBatch(tokens=[[1] * (n + 2) for n in lengths], response_lengths=lengths,
                         rewards=[1.0, 0.0, 0.5, 0.25], loss_masks=[[1] * n for n in lengths])
    batch.old_log_probs, batch.ref_log_probs = old, ref
    from slime.config.rollout_args import rollout_defaults

    args = rollout_defaults(advantage_estimator="reinforce_plus_plus_baseline", n_samples_per_prompt=2, kl_coef=0.3,
                            kl_loss_type=kl_type, normalize_advantages=True)
    share_advantages(args, batch, range(4))
    lr = torch.cat(old).double() - torch.cat(ref).double()
    kl = {"k1": lr, "k2": lr.square() / 2, "low_var_kl": (torch.exp(-lr) - 1 + lr).clamp(-10, 10)}[kl_type]
    base = torch.tensor([0.5, -0.5, 0.125, -0.125], dtype=torch.float64).repeat_interleave(torch.tensor(lengths))
    want = masked_whiten(base - 0.3 * kl, torch.ones(sum(lengths), dtype=torch.float64))
    got = torch.cat([torch.as_tensor(a, dtype=torch.float64) for a in batch.advantages])
    assert torch.allclose(got, want, atol=1e-5)


def test_deliberate_differences_are_one_warning_line_each(tmp_path):
    from slime.config.upstream_differences import upstream_difference_warnings

    assert upstream_difference_warnings(_parse(tmp_path)) == []
    lines = upstream_difference_warnings(_parse(tmp_path, "--rollout-top-p", "0.9",
                                                "--advantage-estimator", "reinforce_plus_plus"))
    assert len(lines) == 2 and all(line.startswith("warning: ") and "\n" not in line for line in lines)
    assert "--rollout-top-p 0.9" in lines[0] and "--normalize-advantages" in lines[1]
    assert upstream_difference_warnings(_parse(tmp_path, "--advantage-estimator", "reinforce_plus_plus",
                                               "--normalize-advantages")) == []


@pytest.mark.parametrize("router_dtype", [None, "fp32", "fp64"])
def test_moe_router_dtype_sets_the_logits_precision(router_dtype):
    """Qwen3-MoE's softmax router in bf16: logits in bf16 by default (transformers' order), fp32/fp64 with the flag."""
    from slime_plugins.models.common.moe import MoELayer

    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 16, generator=g).bfloat16()
    x = torch.randn(5, 16, generator=g).bfloat16()
    layer = SimpleNamespace(arch=SimpleNamespace(router="softmax", num_experts_per_tok=2, norm_topk_prob=True),
                            config=SimpleNamespace(moe_router_dtype=router_dtype), router_weight=w,
                            replay_layer=None)  # (no routing replay)
    weights, idx = MoELayer.route(layer, x)
    dtype = {None: torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[router_dtype]
    probs = torch.softmax(x.to(dtype) @ w.to(dtype).t(), dim=-1, dtype=torch.float32)
    want_w, want_i = torch.topk(probs, 2, dim=-1)
    assert torch.equal(idx, want_i) and torch.allclose(weights, want_w / want_w.sum(-1, keepdim=True), atol=0)


def test_disable_rewards_normalization_uses_raw_rewards():
    from slime.utils.ppo_utils import compute_advantages

    rewards, lengths = torch.tensor([1.0, 0.0, 0.5, 0.5]), [2, 1, 1, 3]
    mask = torch.ones(7)
    raw = compute_advantages("grpo", rewards, lengths, mask, 2, group_normalize=False)
    assert raw.tolist() == [1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    normed = compute_advantages("grpo", rewards, lengths, mask, 2)
    assert normed[0] > 0 > normed[2] and normed[3:].abs().max() == 0  # group 2 has equal rewards


def test_cheap_upstream_flags(tmp_path, capsys):
    args = _parse(tmp_path, "--check-weight-sync", "0", "--check-weight-update-equal", "--train-backend", "megatron",
                  "--rollout-data-transport", "object-store", "--disable-rewards-normalization")
    assert args.check_weight_sync == 1 and args.rewards_normalization is False
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--train-backend", "fsdp")
    assert "invalid choice: 'fsdp'" in capsys.readouterr().err


@pytest.mark.parametrize("kl_type", ["k1", "low_var_kl"])
def test_unbiased_kl_weights_the_kl_loss_by_the_importance_ratio(kl_type):
    from slime.backends.megatron.loss import LossConfig, rl_loss

    g = torch.Generator().manual_seed(3)
    n = 9
    lp = (-torch.rand(n, generator=g, dtype=torch.float64)).requires_grad_()
    old, ref = -torch.rand(n, generator=g, dtype=torch.float64), -torch.rand(n, generator=g, dtype=torch.float64)
    adv, mask, lengths = torch.zeros(n, dtype=torch.float64), torch.ones(n), [4, 5]
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=kl_type, use_unbiased_kl=True)
    loss, metrics = rl_loss(cfg, lp, torch.zeros(n), old, adv, mask, lengths, 1.0, ref_log_probs=ref)
    lr = lp - ref
    kl = lr if kl_type == "k1" else (torch.exp(-lr) - 1 + lr)
    kl = torch.exp(lp - old) * kl
    want = kl[:4].mean() + kl[4:].mean()  # per-sample means, summed (normalizer 1)
    assert torch.allclose(loss.double(), want, atol=1e-6)
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(want, lp)
    assert torch.allclose(g1, g2, atol=1e-6)  # the ratio carries gradient, as upstream's


def test_wandb_group_suffix_and_tensorboard_experiment_dir(tmp_path, monkeypatch):
    import sys
    import types

    from slime.utils import tracking

    calls = {}
    fake = types.ModuleType("wandb")
    fake.util = types.SimpleNamespace(generate_id=lambda: "abc123")
    fake.init = lambda **kw: calls.setdefault("init", kw) and types.SimpleNamespace(log=None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(tracking, "_installed", lambda m: m == "wandb")
    base = ["--use-wandb", "--wandb-project", "p", "--wandb-group", "g", "--wandb-mode", "offline"]
    tracking.Tracker(_parse(tmp_path / "a", *base))
    assert calls.pop("init")["group"] == "g_abc123"  # upstream's random suffix
    tracking.Tracker(_parse(tmp_path / "b", *base, "--disable-wandb-random-suffix"))
    assert calls["init"]["group"] == calls["init"]["name"] == "g"

    made = []
    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = lambda log_dir: made.append(log_dir)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    monkeypatch.setattr(tracking, "_installed", lambda m: m == "tensorboard")
    args = _parse(tmp_path / "c", "--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "exp1",
                  "--output-dir", str(tmp_path / "out"))
    tracking.Tracker(args)
    assert made == [str(tmp_path / "out" / "tensorboard" / "proj" / "exp1")]
