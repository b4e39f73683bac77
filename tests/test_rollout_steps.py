"""A rollout's optimizer steps, as upstream splits them: by rollout id (`Sample.rollout_id`; the samples a forked
agent session gives share one), --global-batch-size rollouts per step, a rollout's samples never split over two
steps, the rollouts after the last whole set not trained. Equal to upstream's rollout ids and steps recorded by
tests/data/record_upstream_rollout_steps_cases.py on tests/data/rollout_steps_cases.py (odd sample and rollout
counts, interleaved forks, samples without an id); with one sample per rollout and a divisible count the steps are
the consecutive slices they always were. The trainer takes exactly those steps (in-process, tiny GLM-5)."""

from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron import data as D
from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from rollout_steps_cases import CASES  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_rollout_steps_cases.json")) as f:
    RECORD = json.load(f)


def _samples(rollout_ids, seed=0):
    rng = random.Random(seed)
    out = []
    for rid in rollout_ids:
        n = rng.randint(1, 4)
        out.append(SimpleNamespace(tokens=[rng.randrange(3, 500) for _ in range(n + rng.randint(1, 5))],
                                   response_length=n, reward=float(rng.random() > 0.5), loss_mask=[1] * n,
                                   rollout_log_probs=[-rng.random() for _ in range(n)], rollout_id=rid))
    return out


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert sorted(RECORD["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rollout_ids_and_steps_equal_upstreams(name):
    case, want = CASES[name], RECORD["cases"][name]
    payload = pack_samples(_samples(case["rollout_ids"]))
    assert payload["rollout_ids"].tolist() == want["rollout_ids"]
    steps = D.batch_steps(batch_from_payload(payload), case["global_batch_size"])
    assert steps == want["steps"]
    assert len(steps) == len(want["global_batch_sizes"])


def test_one_sample_per_rollout_divisible_is_the_consecutive_slices():
    for n, gbs in [(8, 4), (12, 3), (6, 6), (10, 1)]:
        batch = batch_from_payload(pack_samples(_samples([None] * n)))
        assert batch.rollout_ids == list(range(n))
        assert D.batch_steps(batch, gbs) == D.step_indices(n, gbs)
        assert D.batch_steps(batch.select(range(n)), gbs) == D.step_indices(n, gbs)  # ids survive a selection


def test_too_few_rollouts_for_one_step_is_one_line():
    batch = batch_from_payload(pack_samples(_samples([0, 0, 1, 1, 1])))
    with pytest.raises(ValueError, match=r"^5 rollout samples come from 2 rollouts, fewer than one optimizer step "
                                         r"of --global-batch-size 3 rollouts$"):
        D.batch_steps(batch, 3)


def test_a_forked_agent_session_stays_in_one_step():
    """Two sessions of one prompt; the second forks into two samples (its client re-rendered a turn): 3 samples,
    2 rollouts. --global-batch-size 2: one step of all three (the sample count 3 was refused before); 1: two steps,
    the fork's samples together."""
    from slime.agent.trajectory import TrajectoryManager, TurnRecord
    from slime.utils.types import Sample

    def turn(prompt, output):
        return TurnRecord(prompt_ids=prompt, output_ids=output, finish_reason="stop", output_log_probs=[-0.25] * len(output))

    manager = TrajectoryManager(fork_threshold_tokens=0)
    system, user, tool = ({"role": r, "content": r} for r in ("system", "user", "tool"))
    reply = {"role": "assistant", "content": "call"}
    manager.record_turn("a", turn=turn([1, 2, 3], [4, 5]), prompt_messages=[system, user], response_message=reply)
    manager.record_turn("b", turn=turn([1, 2, 3], [6, 7]), prompt_messages=[system, user], response_message=reply)
    manager.record_turn("b", turn=turn([1, 2, 3, 6, 9, 8], [10, 11]), prompt_messages=[system, user, reply, tool],
                        response_message={"role": "assistant", "content": "done"})
    samples = []
    for sid, index in (("a", 0), ("b", 1)):
        samples += manager.get_trajectory(sid, base_sample=Sample(index=index, group_index=0, prompt="p"), reward=1.0)
    batch = batch_from_payload(pack_samples(samples))
    assert batch.rollout_ids == [0, 1, 1]
    assert D.batch_steps(batch, 2) == [[0, 1, 2]]
    assert D.batch_steps(batch, 1) == [[0], [1, 2]]


@pytest.fixture(scope="module")
def actor_and_args(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.config.arguments import parse_args

    ckpt = write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5"))
    args = parse_args(["--hf-checkpoint", ckpt, "--num-rollout", "2", "--global-batch-size", "2",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--lr", "1e-3"])
    actor = MegatronTrainRayActor(1, 0)
    actor.init(args)
    return actor, args


@pytest.mark.parametrize("name", ["agent_forks_interleaved", "ids_set_and_unset"])
def test_the_trainer_takes_upstreams_steps(actor_and_args, name):
    actor, args = actor_and_args
    case, want = CASES[name], RECORD["cases"][name]
    assert case["global_batch_size"] == args.global_batch_size
    trained: list[list[int]] = []
    runner = actor.runner
    real = runner._train_step

    def recording(rollout_id, step_id, batch, step, *rest):
        trained.append(list(step))
        return real(rollout_id, step_id, batch, step, *rest)

    runner._train_step = recording
    try:
        metrics = actor.train_rollout(0, pack_samples(_samples(case["rollout_ids"], seed=3)), True)
    finally:
        del runner._train_step
    assert trained == want["steps"]
    assert metrics["train/steps"] == len(want["global_batch_sizes"]) > 1
    assert metrics["train/reused_log_probs"] == 0.0  # several steps: the old log-probs come from their own forward


def test_a_step_that_does_not_split_over_data_parallel_ranks_is_one_line():
    """Upstream spreads a step's micro-batches over the ranks; here every rank takes an equal share of its samples."""
    steps = D.batch_steps(batch_from_payload(pack_samples(_samples([0, 0, 1]))), 2)
    assert steps == [[0, 1, 2]]
    for shard in (lambda: D.dp_shard(steps[0], 0, 2), lambda: D.balanced_dp_shard(steps[0], [4, 5, 6], 0, 2)):
        with pytest.raises(ValueError, match=r"^3 samples of an optimizer step do not split over 2 data-parallel "
                                             r"ranks \(a step takes whole rollouts"):
            shard()


def test_the_trainer_reduces_a_forked_rollout_to_one_token_mean(actor_and_args, monkeypatch):
    """Two rollouts of 2 and 3 samples (interleaved; some loss tokens masked), one step of --global-batch-size 2
    packed into micro-batches of <= 24 tokens, which split the rollouts. The step reuses its forward's log-probs
    as the old ones (ratio 1, PPO's loss -A per token): its loss and train/pg_loss are upstream's
    -(1/2) sum over rollouts of (sum of A over the rollout's loss tokens / their count), in float64."""
    actor, args = actor_and_args
    monkeypatch.setattr(args, "rollout_batch_size", 1)  # 5 samples != 1 x 1: one reward group of the rollout
    samples = _samples([0, 1, 1, 0, 1], seed=5)
    for k, s in enumerate(samples):
        s.response_length, s.tokens = 4, [3 + (7 * k + 5 * j) % 90 for j in range(6)]
        s.loss_mask = [1, 0, 1, 1] if k % 2 else [1, 1, 1, 1]
        s.rollout_log_probs = [-0.5] * 4
        s.reward = float(k in (1, 3))
    seen = {}
    runner = actor.runner
    real, real_mbs = runner._train_step, runner.policy.micro_batches

    def recording(rollout_id, step_id, batch, step, *rest):
        seen["batch"], seen["step"] = batch, list(step)
        return real(rollout_id, step_id, batch, step, *rest)

    def micro_batches(batch, indices, *a, **kw):
        out = real_mbs(batch, indices, *a, **kw)
        seen.setdefault("mbs", []).append(out)
        return out

    runner._train_step, runner.policy.micro_batches = recording, micro_batches
    try:
        metrics = actor.train_rollout(0, pack_samples(samples), True)
    finally:
        del runner._train_step, runner.policy.micro_batches
    batch = seen["batch"]
    assert seen["step"] == [0, 3, 1, 2, 4] and metrics["train/reused_log_probs"] == 1.0
    train_mbs = seen["mbs"][-1]
    assert len(train_mbs) > 1 and not any(set(mb) >= {1, 2, 4} for mb in train_mbs)  # rollout 1 is split
    want = 0.0
    for members in ([0, 3], [1, 2, 4]):
        adv = sum(float((torch.as_tensor(batch.advantages[i], dtype=torch.float64)
                         * torch.tensor(batch.loss_masks[i], dtype=torch.float64)).sum()) for i in members)
        want += -adv / sum(sum(batch.loss_masks[i]) for i in members)
    want /= 2
    assert abs(want) > 1e-3
    assert metrics["train/loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["train/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
