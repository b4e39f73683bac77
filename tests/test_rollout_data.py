"""Rollout data off the driver: the packed payload round-trips every field, and advantages computed per
data-parallel share (two gloo ranks, uneven shares) equal the whole-batch computation for every estimator."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples, payload_summary, share_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _samples(n=12, seed=0, with_lp=True):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(3, 17)
        r = rng.randint(1, length - 1)
        out.append(SimpleNamespace(tokens=[rng.randrange(3, 500) for _ in range(length)], response_length=r,
                                   reward=float(rng.random() < 0.5) + rng.random() * 0.1,
                                   loss_mask=[int(rng.random() > 0.25) for _ in range(r)] if i % 3 else None,
                                   rollout_log_probs=[-rng.random() for _ in range(r)] if with_lp else None))
    return out


def test_payload_round_trip_and_summary():
    samples = _samples()
    payload = pack_samples(samples)
    batch = batch_from_payload(payload)
    assert batch.tokens == [s.tokens for s in samples]
    assert batch.response_lengths == [s.response_length for s in samples]
    assert batch.rewards == [s.reward for s in samples]
    assert batch.loss_masks == [s.loss_mask or [1] * s.response_length for s in samples]
    for got, s in zip(batch.rollout_log_probs, samples):
        assert got == pytest.approx(s.rollout_log_probs, abs=1e-7)  # float32 on the way
    summary = payload_summary(payload)
    assert summary["rollout/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert summary["rollout/response_tokens"] == sum(s.response_length for s in samples)
    assert batch_from_payload(pack_samples(_samples(with_lp=False))).rollout_log_probs is None


def _args(estimator):
    return SimpleNamespace(advantage_estimator=estimator, n_samples_per_prompt=4, kl_coef=0.05, gamma=0.9,
                           disable_grpo_std_normalization=False, kl_loss_type="k1", normalize_advantages=False,
                           rewards_normalization=True, custom_reward_post_process_path=None)


def _with_log_probs(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    batch.old_log_probs = [-torch.rand(r, generator=g) for r in batch.response_lengths]
    batch.ref_log_probs = [-torch.rand(r, generator=g) for r in batch.response_lengths]
    return batch


WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from test_rollout_data import ESTIMATORS, _args, _samples, _with_log_probs
    from slime.backends.megatron.rollout_data import GroupReduce, batch_from_payload, pack_samples, share_advantages
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = [0, 2, 5, 7, 8, 11, 1] if rank == 0 else [3, 4, 6, 9, 10]   # uneven, interleaved shares
    out = {}
    for est in ESTIMATORS:
        batch = _with_log_probs(batch_from_payload(pack_samples(_samples())))
        metrics = share_advantages(_args(est), batch, mine, GroupReduce(None))
        out[est] = {"adv": {i: batch.advantages[i].tolist() for i in mine}, "metrics": metrics}
    json.dump(out, open(f"{store}.{rank}.json", "w"))
    dist.destroy_process_group()
""")


def test_data_parallel_shares_equal_the_whole_batch(tmp_path):
    store = str(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), store, os.path.join(ROOT, "tests")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    import json

    parts = [json.load(open(f"{store}.{r}.json")) for r in (0, 1)]
    for est in ESTIMATORS:
        whole = _with_log_probs(batch_from_payload(pack_samples(_samples())))
        ref = share_advantages(_args(est), whole, range(len(whole)))
        assert any(float(abs(a).max()) > 0.1 for a in whole.advantages), est  # not trivially zero
        for part in parts:
            for i, adv in part[est]["adv"].items():
                torch.testing.assert_close(torch.tensor(adv), torch.from_numpy(whole.advantages[int(i)]),
                                           rtol=1e-5, atol=1e-6, msg=f"{est} sample {i}")
            for key, value in ref.items():
                assert part[est]["metrics"][key] == pytest.approx(value, rel=1e-6), (est, key)


def test_single_process_share_is_the_whole_batch_formula():
    """share_advantages over all samples is ppo_utils.compute_advantages of the concatenated batch."""
    from slime.utils import ppo_utils

    batch = _with_log_probs(batch_from_payload(pack_samples(_samples(seed=3))))
    share_advantages(_args("reinforce_plus_plus"), batch, range(len(batch)))
    mask = torch.cat([torch.tensor(m, dtype=torch.float32) for m in batch.loss_masks])
    kl = ppo_utils.approx_kl(torch.cat(batch.old_log_probs), torch.cat(batch.ref_log_probs), "k1")
    want = ppo_utils.compute_advantages("reinforce_plus_plus", torch.tensor(batch.rewards), batch.response_lengths,
                                        mask, 4, kl=kl, kl_coef=0.05, gamma=0.9)
    torch.testing.assert_close(torch.cat([torch.from_numpy(a) for a in batch.advantages]), want)
    masked = mask == 0
    assert masked.any() and (want[masked] == 0).all()  # whitening zeroes masked tokens


def _centered(args, samples):
    raw = [s.reward for s in samples]
    mean = sum(raw) / len(raw)
    return raw, [r - mean for r in raw]


def test_custom_reward_post_process_replaces_group_normalization():
    """--custom-reward-post-process-path (upstream's fn(args, samples) -> (raw, rewards)): the trainer's
    advantages are the returned rewards as they are, not group-normalized again."""
    from slime.rollout.plugin_rollout import post_process_rewards

    samples = _samples(8)
    payload = pack_samples(samples)
    args = _args("grpo")
    args.custom_reward_post_process_path = "tests.test_rollout_data._centered"
    metrics = post_process_rewards(args, samples, payload)
    raw, want = _centered(args, samples)
    assert metrics["rollout/raw_reward_mean"] == pytest.approx(sum(raw) / len(raw))
    batch = batch_from_payload(payload)
    share_advantages(args, batch, range(len(batch)))
    for adv, w, n in zip(batch.advantages, want, batch.response_lengths):
        assert adv.tolist() == pytest.approx([w] * n, abs=1e-6)
    args.custom_reward_post_process_path = None  # the default: GRPO group normalization
    batch = batch_from_payload(pack_samples(samples))
    share_advantages(args, batch, range(len(batch)))
    assert batch.advantages[0][0] != pytest.approx(want[0], abs=1e-3)
