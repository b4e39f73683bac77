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
    return SimpleNamespace(advantage_estimator=estimator, n_samples_per_prompt=4, rollout_batch_size=3, kl_coef=0.05,
                           gamma=0.9,
                           disable_grpo_std_normalization=False, kl_loss_type="k1", normalize_advantages=False,
                           rewards_normalization=True, custom_reward_post_process_path=None,
                           custom_convert_samples_to_train_data_path=None, lambd=1.0, use_opd=False,
                           custom_advantage_function_path=None)


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


def _to_train_data(args, samples):
    """An upstream-style conversion: drop the first sample, reward = response length, mask the last token."""
    kept = samples[1:]
    return {"tokens": [s.tokens for s in kept], "response_lengths": [s.response_length for s in kept],
            "rewards": [float(s.response_length) for s in kept], "raw_reward": [s.reward for s in kept],
            "truncated": [0] * len(kept), "sample_indices": list(range(len(kept))),
            "loss_masks": [[1] * (s.response_length - 1) + [0] for s in kept],
            "rollout_log_probs": [s.rollout_log_probs for s in kept]}


def _manager(args, samples):
    """The rollout manager's generate() over given samples (no engines, no Ray)."""
    import contextlib

    from slime.ray.rollout_manager import RolloutManager
    from slime.rollout.data_path import RolloutDataPath

    for s in samples:
        s.weight_versions = ["3"]
    manager = RolloutManager.__new__(RolloutManager)
    manager.args = args
    manager.data = RolloutDataPath.__new__(RolloutDataPath)
    manager.data.args = args
    manager.data.rollout = lambda rollout_id, fleet: (samples, {"rollout/generate_time": 1.0})
    manager._ray = lambda: SimpleNamespace(put=lambda x: x)
    manager.fleet = SimpleNamespace(recovery=SimpleNamespace(serving=contextlib.nullcontext), engines=lambda: [])
    return manager


def _manager_args(**hooks):
    from slime.config.arguments import build_parser

    args = build_parser().parse_args([])  # every flag at its default (the manager reads many), then these
    args.__dict__.update(vars(_args("grpo")))
    args.reward_key = None
    args.custom_rollout_log_function_path = None
    args.__dict__.update(hooks)
    return args


def test_custom_convert_samples_to_train_data_is_the_training_data():
    samples = _samples(6)
    args = _manager_args(custom_convert_samples_to_train_data_path="tests.test_rollout_data._to_train_data",
                         custom_reward_post_process_path="tests.test_rollout_data._centered")  # not applied
    out = _manager(args, samples).generate(0)
    assert out["num_samples"] == 5
    batch = batch_from_payload(out["data"])
    assert batch.tokens == [s.tokens for s in samples[1:]]
    assert batch.loss_masks == [[1] * (s.response_length - 1) + [0] for s in samples[1:]]
    assert batch.rewards == [float(s.response_length) for s in samples[1:]]
    assert out["metrics"]["rollout/reward_mean"] == pytest.approx(sum(batch.rewards) / 5)
    share_advantages(args, batch, range(len(batch)))  # its rewards as they are: no group normalization
    for adv, r, n in zip(batch.advantages, batch.rewards, batch.response_lengths):
        assert adv.tolist() == pytest.approx([r] * n, abs=1e-6)


def test_custom_convert_samples_to_train_data_errors_name_the_problem():
    from slime.rollout.generate import RolloutError
    from slime.rollout.plugin_rollout import train_data_payload

    args = _manager_args(custom_convert_samples_to_train_data_path="tests.test_rollout_data._short_mask")
    with pytest.raises(RolloutError, match="sample 0 has .* 2 loss-mask entries"):
        train_data_payload(args, _samples(2))


def _forked_ids(args, samples):
    """An upstream converter that returns rollout_ids: samples 0-2 one forked rollout, 3 and 4 one each."""
    return {**_to_train_data(args, [None] + samples), "rollout_ids": [7, 7, 7, 2, 9][:len(samples)]}


def test_custom_convert_rollout_ids_reach_the_step_split():
    from slime.backends.megatron.data import batch_steps
    from slime.rollout.generate import RolloutError
    from slime.rollout.plugin_rollout import train_data_payload

    args = _manager_args(custom_convert_samples_to_train_data_path="tests.test_rollout_data._forked_ids")
    batch = batch_from_payload(train_data_payload(args, _samples(5)))
    assert batch.rollout_ids == [7, 7, 7, 2, 9]
    assert batch_steps(batch, 1) == [[0, 1, 2], [3], [4]]  # the fork stays in one step: 3 steps, not 5
    assert batch_steps(batch, 2) == [[0, 1, 2, 3]]  # rollout 9 after the last whole set is not trained
    without = train_data_payload(_manager_args(
        custom_convert_samples_to_train_data_path="tests.test_rollout_data._to_train_data"), _samples(5))
    assert without["rollout_ids"] is None and batch_steps(batch_from_payload(without), 2) == [[0, 1], [2, 3]]
    with pytest.raises(RolloutError, match="rollout_ids has 5 entries for 6 samples"):
        train_data_payload(args, _samples(6))


def _short_mask(args, samples):
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length + 1 for s in samples],
            "rewards": [0.0] * len(samples), "loss_masks": [[1, 1]] * len(samples)}


def _log_and_take_over(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    args.logged.append((rollout_id, len(samples), dict(rollout_extra_metrics), rollout_time))
    return True


def _log_and_keep(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    args.logged.append((rollout_id, len(samples), dict(rollout_extra_metrics), rollout_time))
    return False


@pytest.mark.parametrize("take_over", [True, False])
def test_custom_rollout_log_function_is_called_and_can_take_over(take_over):
    name = "_log_and_take_over" if take_over else "_log_and_keep"
    args = _manager_args(custom_rollout_log_function_path=f"tests.test_rollout_data.{name}", logged=[])
    out = _manager(args, _samples(4)).generate(7)
    (rollout_id, n, seen, seconds), = args.logged
    assert (rollout_id, n) == (7, 4) and seen["rollout/generate_time"] == 1.0 and 0 <= seconds < 60
    assert "rollout/reward_std" in seen  # it sees the built-in metrics
    kept = set(out["metrics"])
    assert ("rollout/generate_time" in kept) is not take_over and ("rollout/reward_std" in kept) is not take_over
    assert {"rollout/reward_mean", "rollout/response_tokens", "rollout/start_time"} <= kept  # the loops read these


def _eval_fn(args, rollout_id, data_source, evaluation=False):
    from slime.rollout.base_types import RolloutFnEvalOutput

    assert evaluation
    return RolloutFnEvalOutput(data={"aime": {"rewards": [1.0, 0.0, 0.5], "truncated": [0, 1, 0], "samples": []}},
                               metrics={"eval/extra": 2.0})


def _eval_log(rollout_id, args, data, extra_metrics):
    args.logged.append((rollout_id, next(iter(data.values()))["rewards"], extra_metrics))
    return args.take_over


@pytest.mark.parametrize("take_over", [True, False])
def test_custom_eval_rollout_log_function_is_called_and_can_take_over(take_over):
    from slime.rollout.plugin_rollout import run_plugin_eval

    args = _manager_args(eval_function_path="tests.test_rollout_data._eval_fn", rollout_num_engines=1,
                           custom_eval_rollout_log_function_path="tests.test_rollout_data._eval_log",
                           logged=[], take_over=take_over)
    metrics = run_plugin_eval(args, 4, None)
    assert args.logged == [(4, [1.0, 0.0, 0.5], {"eval/extra": 2.0})]
    assert ("eval/aime/reward_mean" in metrics) is not take_over and "time/eval" in metrics
    if not take_over:
        assert metrics["eval/aime/reward_mean"] == pytest.approx(0.5)


def _postprocess(args, rollout_id, rollout_data):
    """Upstream-style: mask the last response token of every sample, double the advantages."""
    args.seen = (rollout_id, sorted(rollout_data), list(rollout_data["total_lengths"]))
    for mask in rollout_data["loss_masks"]:
        mask[-1] = 0  # in place, as upstream's tensors allow
    rollout_data["advantages"] = [2 * a for a in rollout_data["advantages"]]


def test_rollout_data_postprocess_changes_what_the_step_trains_on():
    from slime.backends.megatron import data as D
    from slime.backends.megatron.rollout_postprocess import postprocess_rollout_data

    samples = _samples(8)
    batch = batch_from_payload(pack_samples(samples))
    args = _args("grpo")
    share_advantages(args, batch, range(len(batch)))
    before = [torch.as_tensor(a).clone() for a in batch.advantages]
    masks_before = [list(m) for m in batch.loss_masks]
    mine = [1, 4]
    postprocess_rollout_data(_postprocess, args, 9, batch, mine)
    assert args.seen == (9, ["advantages", "loss_masks", "response_lengths", "rewards", "rollout_log_probs",
                             "tokens", "total_lengths"], [len(samples[i].tokens) for i in mine])
    for i in range(8):
        want_mask = masks_before[i][:-1] + [0] if i in mine else masks_before[i]
        assert batch.loss_masks[i] == want_mask
        torch.testing.assert_close(torch.as_tensor(batch.advantages[i]), before[i] * (2 if i in mine else 1))
    packed = D.pack(batch, [4])  # the micro-batch the step trains on carries the new mask
    assert packed.loss_mask.tolist() == [float(x) for x in masks_before[4][:-1] + [0]]
    with pytest.raises(ValueError, match="sample 1's loss_masks has 1 entries"):
        postprocess_rollout_data(lambda a, r, d: d["loss_masks"].__setitem__(0, torch.ones(1)), args, 9, batch, mine)


def test_built_in_evaluation_hands_upstream_eval_data_to_the_eval_log_hook(monkeypatch):
    """The project's own evaluation (slime.rollout.evaluation) fills upstream's {set: {rewards, truncated,
    samples}} for --custom-eval-rollout-log-function-path, as the rollout manager's eval() passes it on."""
    from slime.rollout import evaluation
    from slime.rollout.plugin_rollout import log_eval
    from slime.rollout.eval_datasets import EvalDataset
    from slime.rollout.sample import SampleStatus

    def fake_run(sampling, generator, groups):
        samples = [s for g in groups for s in g]
        for i, s in enumerate(samples):
            s.response_length, s.reward = 2, float(i % 2)
            s.status = SampleStatus.TRUNCATED if i == 0 else SampleStatus.COMPLETED
        return samples

    monkeypatch.setattr(evaluation, "generate_groups", fake_run)
    class OnePrompt:
        def __len__(self):
            return 1

        def next_batch(self, n):
            return [SimpleNamespace(group_index=0, prompt="p", prompt_ids=[5, 6], label="l", metadata={})]

    sets = [evaluation.EvalSet("copy", OnePrompt(), EvalDataset("copy", "copy.jsonl", n_samples_per_eval_prompt=3))]
    args = SimpleNamespace(n_samples_per_eval_prompt=3, eval_temperature=None, eval_top_p=None, eval_top_k=None,
                           eval_max_response_len=None, eval_reward_key=None, reward_key=None,
                           custom_rm_path=None, custom_generate_function_path=None,
                           custom_eval_rollout_log_function_path="tests.test_rollout_data._eval_log",
                           logged=[], take_over=True)
    data: dict = {}
    metrics = evaluation.evaluate(args, None, sets, None, object(), data)
    assert data["copy"]["rewards"] == [0.0, 1.0, 0.0] and data["copy"]["truncated"] == [1, 0, 0]
    assert len(data["copy"]["samples"]) == 3 and metrics["eval/copy/reward_mean"] == pytest.approx(1 / 3)
    kept = log_eval(args, 2, data, None, metrics)
    assert args.logged == [(2, [0.0, 1.0, 0.0], None)] and not any(k.startswith("eval/") for k in kept)
