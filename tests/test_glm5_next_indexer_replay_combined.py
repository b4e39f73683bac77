"""DSA indexer top-k replay (--use-rollout-indexer-replay) together with MoE routing replay
(--use-rollout-routing-replay) and with MTP training (--enable-mtp-training), on the tiny GLM-5.3-Flash of
tests/test_glm5_next_indexer_replay.py (DSA layers 2 and 3, MoE layers 1-4; its helpers are reused).

Both replays: the engine returns both payloads in one rollout and each replay honours its own. A side whose
trainer weights still agree with the engine's needs no replay (replaying it changes nothing); with the trainer's
indexers and routers both changed, only both replays together give the engine's log-probs (1e-5; each one alone
leaves a gap > 1e-3). MTP: the MTP layer's DSA keeps its own selection (the engine does not run it), the main
model's DSA layer is replayed, and a training step with the MTP loss keeps the train/rollout gap at rounding."""

from contextlib import ExitStack

import pytest
import torch
from replay_helpers import all_log_probs, max_diff
from test_glm5_next_indexer_replay import LAYERS, _engine_rollout, _perturb_indexers, _samples

from slime.config.arguments import parse_args

BASE = ["--num-rollout", "1", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--use-rollout-indexer-replay"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5_next"), "glm5_next_text", seed=3)


def _actor(ckpt, *flags):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(1, 0)
    actor.init(parse_args(["--hf-checkpoint", ckpt, *BASE, *flags]))
    return actor


def _log_probs(actor, batch, indexers: bool, routes: bool):
    from slime.utils.indexer_replay import INDEXER_REPLAY
    from slime.utils.routing_replay import REPLAY

    with ExitStack() as stack:
        if indexers:
            stack.enter_context(INDEXER_REPLAY.replaying(batch))
        if routes:
            stack.enter_context(REPLAY.replaying("rollout", batch))
        return all_log_probs(actor, batch)


def _perturb_routers(model, seed=1):
    """Random expert biases: they steer only the choice (the gate weights are the unbiased scores), so a replayed
    choice gives the engine's values again."""
    from slime_plugins.models.common.moe import MoELayer

    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.expert_bias.copy_(4.0 * torch.randn(m.expert_bias.shape, generator=g))


def test_indexer_and_routing_replay_each_honour_their_own_selection(tiny_ckpt):
    """Changed indexers only: routing replay changes nothing (1e-6), indexer replay gives the engine's log-probs.
    Changed routers only: the converse. Both changed: both replays give the engine's (1e-5), either alone not
    (> 1e-3); the whole trainer path (train_rollout, both flags, both forwards) keeps its gap at rounding."""
    from slime.backends.megatron.hf_export import unwrap
    from slime.backends.megatron.rollout_data import pack_samples

    actor = _actor(tiny_ckpt, "--use-rollout-routing-replay")
    assert actor.args.use_routing_replay and actor.args.rollout_router == "in-process"
    samples, batch = _samples(actor.args, _engine_rollout(tiny_ckpt, routed_experts=True))
    assert all(s.rollout_routed_experts.shape == (len(s.tokens) - 1, LAYERS, 2) for s in samples)
    model, want = unwrap(actor.model), batch.rollout_log_probs
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    gap = {}
    for changed in ("indexers", "routers", "both"):
        if changed != "routers":
            _perturb_indexers(model)
        if changed != "indexers":
            _perturb_routers(model)
        gap[changed] = {(i, r): max_diff(_log_probs(actor, batch, i, r), want)
                        for i in (True, False) for r in (True, False)}
        model.load_state_dict(weights, strict=False)
    ind, rou, both = gap["indexers"], gap["routers"], gap["both"]
    assert ind[True, True] <= 1e-5 and abs(ind[True, False] - ind[True, True]) <= 1e-6 and ind[False, True] > 1e-3, ind
    assert rou[True, True] <= 1e-5 and abs(rou[False, True] - rou[True, True]) <= 1e-6 and rou[True, False] > 1e-3, rou
    assert both[True, True] <= 1e-5 and min(both[True, False], both[False, True], both[False, False]) > 1e-3, both
    _perturb_indexers(model)
    _perturb_routers(model)
    m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
    assert m["train_rollout_logprob_abs_diff_max"] <= 1e-5 and m["train/grad_norm"] > 0, m


def test_mtp_training_with_indexer_replay_replays_the_main_layers_only(tiny_ckpt, tmp_path, monkeypatch):
    """A checkpoint with GLM-5.3-Flash's DSA MTP layer (index 5), --enable-mtp-training: under replay only the
    main full DSA layer (2) takes the rollout's rows, the MTP layer selects by itself; with the trainer's
    indexers changed the old log-probs are the engine's (1e-5), and a training step with the MTP loss keeps the
    train/rollout gap at rounding while selecting alone it is large."""
    import shutil

    from glm5_next_helpers import add_mtp_layer

    from slime.backends.megatron.hf_export import unwrap
    from slime.backends.megatron.rollout_data import pack_samples
    from slime_plugins.models.glm5_next import attention

    ckpt = add_mtp_layer(shutil.copytree(tiny_ckpt, tmp_path / "mtp"))
    actor = _actor(ckpt, "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5")
    samples, batch = _samples(actor.args, _engine_rollout(ckpt))
    assert all(torch.as_tensor(s.rollout_indexer_topk).shape[1] == LAYERS for s in samples)  # main layers only
    model = unwrap(actor.model)
    _perturb_indexers(model)  # the MTP layer's indexer too
    seen, original = [], attention.replayed
    monkeypatch.setattr(attention, "replayed", lambda topk, replay, layer: seen.append(layer) or original(
        topk, replay, layer))
    replayed = max_diff(_log_probs(actor, batch, True, False), batch.rollout_log_probs)
    assert set(seen) == {2}, seen
    assert replayed <= 1e-5, replayed
    gaps, weights = {}, {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for flag in (True, False):
        actor.args.use_rollout_indexer_replay = flag
        m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
        gaps[flag] = m["train_rollout_logprob_abs_diff_max"]
        assert m["train/mtp_loss"] > 0 and m["train/grad_norm"] > 0, m
        model.load_state_dict(weights, strict=False)
    assert gaps[True] <= 1e-5 and gaps[False] > 1e-3, gaps
    assert 5 in {m.layer_index for m in model.modules() if isinstance(m, attention.NopeMlaDsaAttention)}
