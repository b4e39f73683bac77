"""Upstream's optional rollout metrics (--log-passrate, --log-multi-turn, --log-reward-category,
--log-correct-samples), --wandb-always-use-train-step's step, and the --ci-test / --ci-save/load-grad-norm checks,
against references computed here by brute force."""

from __future__ import annotations

import itertools
import random
import statistics
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron import ci_checks
from slime.config.arguments import build_parser
from slime.rollout import rollout_metrics as RM
from slime.utils.types import Sample


def _brute_pass_at_k(groups, k):
    """Share of the k-subsets of each group holding a reward of exactly 1, averaged over groups (float64)."""
    out = []
    for g in groups:
        subsets = list(itertools.combinations(range(len(g)), k))
        out.append(sum(any(g[i] == 1 for i in s) for s in subsets) / len(subsets))
    return statistics.fmean(out)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_pass_at_k_equals_enumerating_subsets(n):
    rng = random.Random(n)
    groups = [[rng.choice([0, 1, 0.5, 1.0, 0.0]) for _ in range(n)] for _ in range(7)]
    groups.append([1] * n)  # every sample passes
    groups.append([0.999] * n)  # close to 1 is not a pass
    got = RM.pass_at_k(groups)
    ks = [k for k in (1, 2, 4, 8) if k <= n]
    assert sorted(got) == sorted(f"passrate/pass@{k}" for k in ks)
    for k in ks:
        assert got[f"passrate/pass@{k}"] == pytest.approx(_brute_pass_at_k(groups, k), abs=1e-12)
    assert RM.pass_at_k([[1.0]] * 3) == {}  # groups of one: nothing (upstream's)
    with pytest.raises(ValueError, match="groups of equal size"):
        RM.pass_at_k([[1, 0], [1]])


def _sample(group, reward, length, mask=None, lps=None, rounds=None):
    s = Sample(group_index=group, reward=reward, response_length=length, loss_mask=mask, rollout_log_probs=lps)
    if rounds is not None:
        s.metadata["round_number"] = rounds
    return s


def test_multi_turn_lengths_without_tool_tokens_and_rounds():
    samples = [_sample(0, 1.0, 6, [1, 1, 0, 0, 1, 1], rounds=2), _sample(0, 0.0, 3, [1, 1, 1], rounds=1),
               _sample(1, 0.0, 8, [1, 0, 0, 0, 0, 0, 0, 1], rounds=4)]
    m = RM.multi_turn(samples, max_response_len=8)
    assert m["multi_turn/raw_response_length/response_length_mean"] == pytest.approx(17 / 3)
    assert m["multi_turn/raw_response_length/response_length_clip_ratio"] == pytest.approx(1 / 3)
    assert m["multi_turn/wo_obs_response_length/response_length_mean"] == pytest.approx((4 + 3 + 2) / 3)
    assert m["multi_turn/wo_obs_response_length/response_length_min"] == 2.0
    assert (m["multi_turn/multi_turn_metric/round_number_max"], m["multi_turn/multi_turn_metric/round_number_mean"]) \
        == (4.0, pytest.approx(7 / 3))


def test_reward_categories_and_their_one_line_error():
    samples = [_sample(0, {"score": 0.0, "why": "format"}, 2), _sample(0, {"score": 1.0, "why": "ok"}, 2),
               _sample(1, {"score": 0.0, "why": "format"}, 2), _sample(1, {"score": 0.0, "why": "wrong"}, 2)]
    assert RM.reward_categories(samples, "why") == {"rollout/error_cat/format": 0.5, "rollout/error_cat/ok": 0.25,
                                                    "rollout/error_cat/wrong": 0.25}
    with pytest.raises(ValueError, match="--log-reward-category 'why'.*not a dict"):
        RM.reward_categories([_sample(0, 1.0, 2)], "why")


def test_correct_samples_length_quarters_and_mean_negative_log_prob():
    samples = [_sample(0, 1.0, 2, [1, 1], [-0.5, -1.5]),           # <= 25% of 8
               _sample(0, 1.0, 5, [1, 0, 1, 1, 1], [-1, -9, -1, -1, -1]),  # in (50%, 75%]; masked token skipped
               _sample(0, 0.0, 8, [1] * 8, [-3.0] * 8),              # not correct: ignored
               _sample(1, 1.0, 8, [1] * 8, [-0.25] * 8)]             # the last quarter
    m = RM.correct_samples(samples, None, max_response_len=8)
    assert [m[f"rollout/correct_length/p{p}"] for p in (25, 50, 75, 100)] == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3])
    assert m["rollout/correct_entropy"] == pytest.approx((1.0 + 1.0 + 0.25) / 3)
    assert m["rollout/correct_samples"] == 3.0


def parse_args(argv):  # the flags' namespace without the run's validation (no checkpoint needed)
    return build_parser().parse_args(argv)


def test_rollout_metrics_follow_the_flags():
    args = parse_args(["--log-passrate", "--log-reward-category", "why", "--reward-key", "score"])
    samples = [_sample(g, {"score": float(g == 0), "why": "x"}, 3, [1, 1, 1], [-1.0] * 3) for g in (0, 0, 1, 1)]
    m = RM.rollout_metrics(args, samples)
    assert m["passrate/pass@1"] == 0.5 and m["passrate/pass@2"] == 0.5 and m["rollout/error_cat/x"] == 1.0
    assert not any(k.startswith(("multi_turn/", "rollout/correct")) for k in m)
    assert RM.rollout_metrics(parse_args([]), samples) == {}


def test_tracker_steps_by_train_steps_only_when_asked():
    from slime.utils.tracking import Tracker

    base = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8"]
    assert Tracker(parse_args(base)).step_of(3) == 3
    # 16 samples per rollout in steps of 8: 2 optimizer steps per rollout
    assert Tracker(parse_args(base + ["--wandb-always-use-train-step"])).step_of(3) == 6


def _ci(**kw):
    base = dict(ci_test=True, ci_disable_kl_checker=False, ci_train_rollout_logprob_abs_diff_threshold=0.1,
                ci_save_grad_norm=None, ci_load_grad_norm=None, use_rollout_logprobs=False,
                use_rollout_routing_replay=False)
    return SimpleNamespace(**{**base, **kw})


def test_ci_log_prob_checks():
    lp = [torch.tensor([-0.2, -0.4, -9.0]), None, torch.tensor([-0.6])]
    masks = [[1, 1, 0], [1], [1]]
    ci_checks.check_log_probs(_ci(), 0, lp, [t.clone() if t is not None else None for t in lp], masks)
    ref = [torch.tensor([-0.2, -0.4, -9.0]), None, torch.tensor([-0.6 + 1e-6])]
    with pytest.raises(ci_checks.CICheckError, match="rollout 0's mean log-prob .* reference"):
        ci_checks.check_log_probs(_ci(), 0, lp, ref, masks)
    ci_checks.check_log_probs(_ci(ci_disable_kl_checker=True), 0, lp, ref, masks)  # the KL checker is off
    ci_checks.check_log_probs(_ci(use_rollout_routing_replay=True), 0, lp, ref, masks)  # the actor routes as the engine
    ci_checks.check_log_probs(_ci(), 1, lp, ref, masks)  # only rollout 0 compares with the reference
    with pytest.raises(ci_checks.CICheckError, match=r"outside \(-1, 0\)"):
        ci_checks.check_log_probs(_ci(), 3, [torch.tensor([-4.0])], None, [[1]])
    ci_checks.check_log_probs(_ci(ci_test=False), 3, [torch.tensor([-4.0])], None, [[1]])


def test_ci_first_step_and_mismatch_checks():
    ci_checks.check_first_step(_ci(), 0, 0, ppo_kl=1e-10, kl=0.0)
    with pytest.raises(ci_checks.CICheckError, match="step 0's ppo_kl"):
        ci_checks.check_first_step(_ci(), 2, 0, ppo_kl=-3e-7, kl=None)
    ci_checks.check_first_step(_ci(), 2, 1, ppo_kl=0.5, kl=None)  # later steps: the policy has moved
    with pytest.raises(ci_checks.CICheckError, match="KL to the reference"):
        ci_checks.check_first_step(_ci(), 0, 0, ppo_kl=0.0, kl=2e-8)
    ci_checks.check_first_step(_ci(), 1, 0, ppo_kl=0.0, kl=0.3)  # the KL is checked at the run's first step only
    ci_checks.check_mismatch(_ci(), {"train_rollout_logprob_abs_diff": 0.05})
    with pytest.raises(ci_checks.CICheckError, match="above --ci-train-rollout-logprob-abs-diff-threshold 0.01"):
        ci_checks.check_mismatch(_ci(ci_train_rollout_logprob_abs_diff_threshold=0.01),
                                 {"train_rollout_logprob_abs_diff": 0.05})


def test_ci_grad_norm_recorded_then_required(tmp_path):
    template = str(tmp_path / "gn" / "{role}-{rollout_id}-{step_id}.pt")
    ci_checks.record_grad_norm(_ci(ci_save_grad_norm=template), 3, 1, 2.5, rank=0)
    ci_checks.record_grad_norm(_ci(ci_save_grad_norm=template), 3, 2, 9.0, rank=1)  # rank 0 alone writes
    assert sorted(p.name for p in (tmp_path / "gn").iterdir()) == ["actor-3-1.pt"]
    load = _ci(ci_load_grad_norm=template)
    ci_checks.record_grad_norm(load, 3, 1, 2.5 * 1.009, rank=1)
    with pytest.raises(ci_checks.CICheckError, match="rollout 3 step 1's grad norm 2.6 differs from the recorded 2.5"):
        ci_checks.record_grad_norm(load, 3, 1, 2.6, rank=0)
    with pytest.raises(ci_checks.CICheckError, match="does not exist; record it first with --ci-save-grad-norm"):
        ci_checks.record_grad_norm(load, 4, 0, 2.5, rank=0)


def test_dump_details_sets_both_dumps_and_the_train_file_is_atomic(tmp_path):
    from slime.backends.megatron import train_dump
    from slime.config.arguments import ArgumentError
    from slime.config.observability_args import apply_dump_details

    args = parse_args(["--dump-details", str(tmp_path / "d")])
    apply_dump_details(args)
    assert args.save_debug_rollout_data == f"{tmp_path}/d/rollout_data/{{rollout_id}}.pt"
    assert args.save_debug_train_data == f"{tmp_path}/d/train_data/{{rollout_id}}.pt"
    same = parse_args(["--save-debug-train-data", "x/{rollout_id}.pt", "--save-debug-rollout-data", "x/{rollout_id}.pt"])
    with pytest.raises(ArgumentError, match="must differ from --save-debug-rollout-data"):
        apply_dump_details(same)
    with pytest.raises(ArgumentError, match=r"only \{rollout_id\} and \{rank\}"):
        apply_dump_details(parse_args(["--save-debug-train-data", "x/{step}.pt"]))
    shards = [{"rank": 0, "data_parallel_rank": 0, "rollout_data": {"partition": [2, 0], "response_lengths": [1, 1],
                                                                      "x": [1, 2]}},
              {"rank": 1, "data_parallel_rank": 1, "rollout_data": {"partition": [1], "response_lengths": [1], "x": [3]}}]
    path = train_dump.save_train_data(str(tmp_path / "t" / "{rollout_id}-{rank}.pt"), 4, 0, shards)
    data = torch.load(path, weights_only=True)
    assert path.endswith("4-0.pt") and not any(p.name.endswith(".tmp") for p in (tmp_path / "t").iterdir())
    assert [(s["rollout_position"], s["x"]) for s in data["samples"]] == [(0, 2), (1, 3), (2, 1)]
    assert [(d["data_parallel_rank"], d["partition"]) for d in data["dp_shards"]] == [(0, [2, 0]), (1, [1])]
