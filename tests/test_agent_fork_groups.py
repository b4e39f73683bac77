"""An agent session that forks gives its prompt more samples than --n-samples-per-prompt. The rewards GRPO's
group advantages are computed from then equal upstream's (slime/ray/rollout.py `_post_process_rewards`, recorded by
tests/data/record_upstream_group_rewards_cases.py at the commit it names on tests/data/group_rewards_cases.py):
groups of --n-samples-per-prompt only when the rollout holds exactly --rollout-batch-size x that many samples,
otherwise the whole rollout as one group. Tolerance 1e-6 (upstream's float32 arithmetic)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples, share_advantages

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from group_rewards_cases import CASES  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_group_rewards_cases.json")) as f:
    RECORD = json.load(f)


def capture_rewards(args, rollout_data) -> None:
    """A --custom-advantage-function-path: keeps the rewards it was handed (on args), advantages 0."""
    args.captured.append(list(rollout_data["rewards"]))
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"]]


def _args(case, custom=None):
    return SimpleNamespace(advantage_estimator=case["advantage_estimator"],
                           n_samples_per_prompt=case["n_samples_per_prompt"],
                           rollout_batch_size=case["rollout_batch_size"], kl_coef=0.0, gamma=1.0, lambd=1.0,
                           disable_grpo_std_normalization=not case["grpo_std_normalization"], kl_loss_type="k1",
                           normalize_advantages=False, rewards_normalization=case["rewards_normalization"],
                           custom_reward_post_process_path=None, custom_convert_samples_to_train_data_path=None,
                           use_opd=False, use_rollout_logprobs=False, custom_advantage_function_path=custom)


def _batch(rewards):
    lengths = [1 + i % 3 for i in range(len(rewards))]
    samples = [SimpleNamespace(tokens=[3] * (n + 2), response_length=n, reward=r, loss_mask=[1] * n,
                               rollout_log_probs=[-0.5] * n) for r, n in zip(rewards, lengths)]
    batch = batch_from_payload(pack_samples(samples))
    batch.values = [torch.zeros(n) for n in lengths]  # ppo's critic values (no critic here)
    return batch


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert sorted(RECORD["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewards_the_estimator_sees_equal_upstreams(name):
    case, want = CASES[name], RECORD["cases"][name]["rewards"]
    batch, args = _batch(case["rewards"]), _args(case, "tests.test_agent_fork_groups.capture_rewards")
    args.captured = []
    share_advantages(args, batch, range(len(batch)))
    assert args.captured[0] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c["advantage_estimator"] in ("grpo", "gspo", "cispo")))
def test_group_advantages_equal_upstreams_rewards(name):
    case, want = CASES[name], RECORD["cases"][name]["rewards"]
    batch = _batch(case["rewards"])
    share_advantages(_args(case), batch, range(len(batch)))
    for advantages, reward, n in zip(batch.advantages, want, batch.response_lengths):
        assert torch.as_tensor(advantages).tolist() == pytest.approx([reward] * n, abs=1e-6)


def _turn(prompt, output):
    from slime.agent.trajectory import TurnRecord

    return TurnRecord(prompt_ids=prompt, output_ids=output, finish_reason="stop",
                      output_log_probs=[-0.25] * len(output))


def test_a_forked_session_trains_with_upstreams_group_advantages():
    """Two sessions of one prompt (--n-samples-per-prompt 2, --rollout-batch-size 1); the second re-renders its
    history differently (a token the first turn's output does not have), so it forks into two samples."""
    from slime.agent.trajectory import TrajectoryManager
    from slime.utils.types import Sample

    manager = TrajectoryManager(fork_threshold_tokens=0)
    system, user, tool = ({"role": r, "content": r} for r in ("system", "user", "tool"))
    reply = {"role": "assistant", "content": "call"}
    manager.record_turn("a", turn=_turn([1, 2, 3], [4, 5]), prompt_messages=[system, user], response_message=reply)
    manager.record_turn("b", turn=_turn([1, 2, 3], [6, 7]), prompt_messages=[system, user], response_message=reply)
    manager.record_turn("b", turn=_turn([1, 2, 3, 6, 9, 8], [10, 11]), prompt_messages=[system, user, reply, tool],
                        response_message={"role": "assistant", "content": "done"})
    samples = []
    for sid, index, reward in (("a", 0, 1.0), ("b", 1, 0.0)):
        base = Sample(index=index, group_index=0, prompt="p")
        samples += manager.get_trajectory(sid, base_sample=base, reward=reward)
    assert [(s.index, s.group_index, s.rollout_id) for s in samples] == [(0, 0, 0), (1, 0, 1), (1, 0, 1)]
    assert [s.tokens for s in samples] == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 9, 8, 10, 11]]
    case = CASES["agent_session_forked"]
    assert [s.reward for s in samples] == case["rewards"]
    batch = batch_from_payload(pack_samples(samples))
    share_advantages(_args(case), batch, range(len(batch)))
    want = RECORD["cases"]["agent_session_forked"]["rewards"]
    for advantages, reward, mask in zip(batch.advantages, want, batch.loss_masks):
        assert torch.as_tensor(advantages).tolist() == pytest.approx([reward] * len(mask), abs=1e-6)
