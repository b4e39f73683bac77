"""Trainer flags of upstream's that change what the optimizer does, on the real trainer actor (one rank, the
tiny GLM-5, two train steps on a fixed rollout batch): --freeze-params-name-list and
--only-train-params-name-list (this model's names and upstream's Megatron names), --reset-optimizer-states; and
the profiler flags (--use-pytorch-profiler per --profile-target, --record-memory-history on the host) and
--log-probs-max-tokens-per-gpu, --use-stateless-adam, --ref-update-interval."""

from __future__ import annotations

import os

import pytest
import torch

from glm5_helpers import rl_batch, spawn_ranks, write_checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from trainer_options_worker import CONFIGS, run

    d = tmp_path_factory.mktemp("trainer_options")
    ckpt = write_checkpoint(d / "ckpt", "glm_moe_dsa", seed=3)
    batch = str(d / "batch.pt")
    torch.save(rl_batch(8, 0, lengths=(10, 16), responses=(3, 7)), batch)
    spawn_ranks(run, 1, ckpt, batch, str(d), list(CONFIGS))
    out = {name: torch.load(os.path.join(d, f"{name}.pt"), weights_only=False) for name in CONFIGS}
    out["dir"] = d
    return out


def test_freeze_list_keeps_exactly_those_weights(results):
    plain, got = results["plain"], results["freeze_embeddings"]
    frozen = {n for n in got["trainable"] if n.startswith(("embedding", "output_layer"))}
    assert frozen == {"embedding.weight", "output_layer.weight"}
    trainable = {n for n, t in plain["trainable"].items() if t}  # (the DSA indexer is not trained by default)
    assert trainable - {n for n, t in got["trainable"].items() if t} == frozen
    assert not any(got["moved"][n] for n in frozen)
    assert all(plain["moved"][n] for n in frozen)  # without the flag the steps move them
    moved = {n for n, m in got["moved"].items() if m}
    assert moved == {n for n, m in plain["moved"].items() if m} - frozen
    assert len(got["states"]) == len(plain["states"]) - 2  # no Adam state for frozen weights
    assert len(moved) > 20


def test_only_train_list_matches_upstream_megatron_names(results):
    got = results["only_upstream_names"]
    expected = {n for n in got["trainable"] if n.endswith("mlp.experts.weight1")} | \
        {"decoder.layers.1.self_attention.q_a_proj.weight"}
    assert len(expected) >= 3  # two MoE layers' experts and one attention weight
    assert {n for n, t in got["trainable"].items() if t} == expected
    assert {n for n, m in got["moved"].items() if m} == expected


def test_reset_optimizer_states_restarts_adam_each_rollout(results):
    """(--use-stateless-adam: the same at every optimizer step, here two per rollout.)"""
    b1, b2 = results["reset"]["betas"]
    for name, step_count in (("plain", 2), ("reset", 1), ("stateless_adam", 1)):
        assert all(step == step_count for step, _, _ in results[name]["states"]), name
    # Moments from one gradient g: m = (1-b1) g, v = (1-b2) g^2, so v (1-b1)^2 = (1-b2) m^2 exactly up to
    # rounding; after two steps without the reset the relation breaks.
    def worst(name):
        return max(float(((v * (1 - b1) ** 2 - (1 - b2) * m * m).abs().max() / (v.abs().max() + 1e-30)))
                   for _, m, v in results[name]["states"])
    assert worst("reset") < 1e-5 and worst("stateless_adam") < 1e-5
    assert worst("plain") > 1e-3  # (the same batch twice: the two gradients are close)


def _trace_ops(path) -> set[str]:
    import gzip
    import json

    with gzip.open(path, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_profiler_writes_a_trace_per_target(results):
    traces = results["dir"] / "traces"
    files = sorted(p.name for p in traces.iterdir())
    for target in ("train_overall", "train_actor", "train_log_probs"):
        mine = [f for f in files if f.startswith(f"{target}_rank_0.") and f.endswith(".pt.trace.json.gz")]
        assert len(mine) >= 1, (target, files)
        ops = _trace_ops(traces / mine[0])
        assert any(op.startswith("aten::") and ("mm" in op or "matmul" in op) for op in ops), (target, sorted(ops)[:20])
    actor = _trace_ops(traces / next(f for f in files if f.startswith("train_actor_rank_0.")))
    assert any("backward" in op.lower() for op in actor)  # an optimizer step's trace holds the backward pass
    log_probs = _trace_ops(traces / next(f for f in files if f.startswith("train_log_probs_rank_0.")))
    assert not any("backward" in op.lower() for op in log_probs)  # no grad
    assert not (results["dir"] / "memory").exists() or not list((results["dir"] / "memory").iterdir())


def test_profiler_flag_errors():
    from slime.config.arguments import ArgumentError, build_parser
    from slime.config.observability_args import validate_profiler_args

    args = build_parser().parse_args(["--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"])
    with pytest.raises(ArgumentError, match="--profile-step-end 3 must be greater than --profile-step-start 3"):
        validate_profiler_args(args)
    args = build_parser().parse_args(["--use-pytorch-profiler", "--profile-target", "train_overall", "train_actor"])
    with pytest.raises(ArgumentError, match="profile train_overall alone"):
        validate_profiler_args(args)
    args = build_parser().parse_args(["--record-memory-history", "--memory-recorder", "memray"])
    with pytest.raises(ArgumentError, match="memray needs --memory-snapshot-num-steps"):
        validate_profiler_args(args)


def test_log_probs_budget_packs_differently_with_equal_results(results):
    """--log-probs-max-tokens-per-gpu 16 (one sample per micro-batch here) gives the log-probs of the default
    budget (64 tokens: several samples packed per micro-batch)."""
    plain, small = results["plain"]["log_probs"], results["profile"]["log_probs"]
    assert sorted(plain) == sorted(small) == list(range(8))
    for i in plain:
        torch.testing.assert_close(small[i], plain[i], rtol=0, atol=1e-5)


def test_ref_update_interval_copies_the_actor_every_n_rollouts(results):
    assert results["ref_update"]["refs"] == [(False, False), (True, True)]
    assert results["plain"]["refs"] == []  # no reference without a KL term


def test_balance_by_flops_trains_the_same_step(results):
    """Other micro-batches, the same step: equal losses and the same weights moved."""
    plain, flops = results["plain"], results["balance_flops"]
    assert flops["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert flops["moved"] == plain["moved"]


def test_rollout_entropy_reaches_the_hooks(results):
    """--use-rollout-entropy: the old-policy pass's per-token entropy, in the hooks' rollout_data; its masked
    token mean is rollout/entropy and equals the training forward's (same weights, per-token loss)."""
    got = results["entropy"]
    ent, masks = got["entropy"], got["loss_masks"]
    assert len(ent) == 8 and all(e.shape == m.shape for e, m in zip(ent, masks))
    assert all(float(e.min()) >= 0 and float(e.max()) <= float(torch.log(torch.tensor(512.0))) + 1e-4 for e in ent)
    mean = sum(float((e.double() * m).sum()) for e, m in zip(ent, masks)) / sum(float(m.sum()) for m in masks)
    assert got["metrics"]["rollout/entropy"] == pytest.approx(mean, rel=1e-6)
    assert got["metrics"]["train/entropy"] == pytest.approx(mean, rel=1e-5)
