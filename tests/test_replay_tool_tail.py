"""Rollout routing replay and indexer top-k replay of a multi-turn sample whose last piece is a tool/environment
turn (`append_response_tokens(..., trainable=False)` after a model turn): the engine's last request fed every
token up to the model turn's last, so the sample carries rows for those only. The payload fills the tail's rows
as NOT_FED and the trainer keeps its own choice there (as for each sample's last token); every fed token replays
the engine's row. On the tiny GLM-5.3-Flash (tests/test_glm5_next_indexer_replay.py's engine and prompts) with
the trainer's indexers and routers changed, both replays give the engine's log-probs on every trained token
(1e-5), the tail's rows change nothing trained (1e-6), and a training step packs and trains such samples."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_glm5_next_indexer_replay import LAYERS, NEW, PROMPTS, _engine_rollout, _perturb_indexers
from test_glm5_next_indexer_replay_combined import _actor, _log_probs, _perturb_routers

from slime.utils.indexer_replay import encode
from slime.utils.routing_replay import NOT_FED, rows_as_packed
from slime.utils.types import Sample

ARGS = SimpleNamespace(num_layers=2, moe_router_topk=2)
OBSERVATIONS = [[17, 18, 19], [20], [21, 22, 23, 24, 25], []]  # the last sample ends with its model turn


def _model_turn(sample, rows, response, start=0):
    """A model turn as the engine answers it: its tokens and log-probs, the routes of the fed tokens from
    `start` on and the indexer rows of all of them."""
    fed = len(sample.tokens) + len(response) - 1
    meta = {"finish_reason": {"type": "stop"}, "routed_experts": encode(rows["experts"][start:fed]),
            "routed_experts_start_len": start, "indexer_topk": encode(rows["topk"][:fed])}
    sample.append_response_tokens(ARGS, tokens=response, log_probs=[-0.5] * len(response), meta_info=meta)


def _engine_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"experts": torch.randint(0, 8, (n, 2, 2), generator=g, dtype=torch.int32),
            "topk": torch.randint(-1, n, (n, 2, 3), generator=g, dtype=torch.int32)}


def _tool_ending_sample(experts=None):
    rows = _engine_rows(32)
    if experts is not None:
        rows["experts"] = experts
    s = Sample(index=0, tokens=[1, 2, 3], reward=1.0)
    _model_turn(s, rows, [4, 5, 6])
    s.append_response_tokens(ARGS, tokens=[7, 8], trainable=False)  # a tool call's observation
    _model_turn(s, rows, [9, 10], start=4)  # the engine had 4 tokens cached: it returns the routes from there on
    s.append_response_tokens(ARGS, tokens=[11, 12, 13], trainable=False)  # ...and the sample ends with one
    return s, rows


def _micro_batch(lengths):
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return SimpleNamespace(tokens=torch.zeros(1, int(starts[-1]) + 2), cu_seqlens=torch.tensor(starts),
                           sample_indices=list(range(len(lengths))), cp=None)


def test_a_tool_ending_sample_packs_with_its_fed_rows_and_not_fed_tail():
    """The sample keeps one row per fed token (upstream's Sample does the same); the payload lays out len - 1 rows,
    the tail NOT_FED; the micro-batch layout replays exactly the engine's rows and marks the tail unreplayed."""
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

    s, rows = _tool_ending_sample()
    fed = 3 + 3 + 2 + 2 - 1  # the second model turn's request fed everything up to its last token
    assert len(s.tokens) == 13 and s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert torch.equal(torch.as_tensor(s.rollout_routed_experts), rows["experts"][:fed])
    assert torch.equal(torch.as_tensor(s.rollout_indexer_topk), rows["topk"][:fed])
    other = Sample(index=1, tokens=[1, 2], reward=0.0)
    _model_turn(other, _engine_rows(8, seed=1), [3, 4, 5])
    batch = batch_from_payload(pack_samples([s, other]))
    mb = _micro_batch([13, 5])
    for name, fill in (("rollout_routed_experts", 0), ("rollout_indexer_topk", -1)):
        payload = torch.as_tensor(getattr(batch, name)[0])
        assert payload.shape[0] == 12 and bool((payload[fed:] == NOT_FED).all())
        want = rows["experts" if fill == 0 else "topk"][:fed]
        ids, valid = rows_as_packed(getattr(batch, name), batch.tokens, mb, tuple(payload.shape[1:]), fill,
                                    lambda *a: AssertionError(a))
        assert valid.tolist() == [True] * fed + [False] * 4 + [True] * 4 + [False] * 3
        assert torch.equal(ids[:fed], want) and bool((ids[fed:13] == fill).all())
        assert torch.equal(ids[13:17], torch.as_tensor(getattr(batch, name)[1]))


def test_a_trained_token_after_the_fed_rows_is_refused():
    """A model turn appended without its meta_info leaves trained tokens without the engine's rows: one line."""
    from slime.rollout.train_payload import pack_samples

    s, _ = _tool_ending_sample()
    s.append_response_tokens(ARGS, tokens=[14, 15], log_probs=[-1.0, -1.0])
    with pytest.raises(ValueError, match=r"sample 0: rollout_routed_experts covers the first 9 tokens .* token 13 "):
        pack_samples([s])


def test_the_sample_is_upstreams_and_upstreams_trainer_refuses_it():
    """Upstream's Sample builds the same tokens, loss mask, log-probs and rows (the fed tokens': 9 of 12) from the
    same engine answers; upstream's trainer (prepare_routed_experts_for_routing_replay) then refuses it with a bare
    assertion (recorded: tests/data/upstream_tool_tail_cases.json), and so does this project's copy of that path
    (one line); this project's trainer path packs it: the engine's 9 rows, 3 NOT_FED."""
    import json
    import os

    from slime.backends.megatron_utils import cp_utils
    from slime.rollout.train_payload import pack_samples

    with open(os.path.join(os.path.dirname(__file__), "data", "upstream_tool_tail_cases.json")) as f:
        up = json.load(f)
    assert up["repository"] == "THUDM/slime" and len(up["commit"]) == 40
    assert up["trainer_refuses"]["type"] == "AssertionError"
    s, _ = _tool_ending_sample(torch.tensor(up["engine_routes"], dtype=torch.int32))
    assert (s.tokens, s.loss_mask, s.rollout_log_probs) == (up["tokens"], up["loss_mask"], up["rollout_log_probs"])
    assert torch.as_tensor(s.rollout_routed_experts).tolist() == up["rollout_routed_experts"]
    with pytest.raises(ValueError, match="do not cover tokens .* but the last"):
        cp_utils.prepare_routed_experts_for_routing_replay([torch.as_tensor(s.rollout_routed_experts)],
                                                           [torch.tensor(s.tokens)], num_experts=8,
                                                           data_pad_size_multiplier=1, sequence_parallel=False,
                                                           allgather_cp=False)
    packed = pack_samples([s])["rollout_routed_experts"]
    assert packed[:9].tolist() == up["rollout_routed_experts"] and bool((packed[9:] == NOT_FED).all())


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5_next"), "glm5_next_text", seed=3)


def test_tool_ending_samples_replay_the_engines_rows_and_train(tiny_ckpt):
    """Three of four engine samples end with an observation (1-5 tokens). With the trainer's indexers and routers
    changed, both replays give the engine's log-probs on every trained token (1e-5; neither > 1e-3); the tail's
    rows (NOT_FED, or upstream's filler experts / the engine-fed token's keys) change nothing trained (1e-6);
    train_rollout with both flags trains them at the engine's log-probs."""
    from slime.backends.megatron.hf_export import unwrap
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

    actor = _actor(tiny_ckpt, "--use-rollout-routing-replay")
    samples = []
    for i, (prompt, out, obs) in enumerate(zip(PROMPTS, _engine_rollout(tiny_ckpt, routed_experts=True),
                                               OBSERVATIONS)):
        s = Sample(index=i, tokens=list(prompt), reward=float(i % 2))
        pairs = out["meta_info"]["output_token_logprobs"]
        s.append_response_tokens(actor.args, tokens=[x[1] for x in pairs], log_probs=[x[0] for x in pairs],
                                 meta_info=out["meta_info"])
        s.append_response_tokens(actor.args, tokens=obs, trainable=False)
        samples.append(s)
    batch = batch_from_payload(pack_samples(samples))
    for s, prompt, routes, topk in zip(samples, PROMPTS, batch.rollout_routed_experts, batch.rollout_indexer_topk):
        fed = len(prompt) + NEW - 1
        assert torch.equal(torch.as_tensor(routes)[:fed], torch.as_tensor(s.rollout_routed_experts))
        assert torch.equal(torch.as_tensor(topk)[:fed], torch.as_tensor(s.rollout_indexer_topk))
        assert bool((torch.as_tensor(routes)[fed:] == NOT_FED).all()) and len(routes) == len(s.tokens) - 1

    def trained_gap(replay, changed=batch):
        got = _log_probs(actor, changed, replay, replay)
        return max(float((g - torch.tensor(w))[torch.tensor(m, dtype=torch.bool)].abs().max())
                   for g, w, m in zip(got, batch.rollout_log_probs, batch.loss_masks)), got

    model = unwrap(actor.model)
    _perturb_indexers(model)
    _perturb_routers(model)
    (replayed, got), (own, _) = trained_gap(True), trained_gap(False)
    assert replayed <= 1e-5 and own > 1e-3, (replayed, own)
    filled = batch_from_payload(pack_samples(samples))  # the tail filled otherwise: upstream's arange % experts
    for routes, topk in zip(filled.rollout_routed_experts, filled.rollout_indexer_topk):
        tail = routes[:, 0, 0] == NOT_FED
        routes[tail] = torch.arange(int(tail.sum()) * LAYERS * 2, dtype=torch.int32).reshape(-1, LAYERS, 2) % 8
        topk[tail] = topk[~tail][-1]  # the last fed token's keys: all visible to every tail token
    _, refilled = trained_gap(True, filled)
    masks = [torch.tensor(m, dtype=torch.bool) for m in batch.loss_masks]
    assert max(float((a - b)[m].abs().max()) for a, b, m in zip(got, refilled, masks)) <= 1e-6
    m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
    assert m["train_rollout_logprob_abs_diff_max"] <= 1e-5 and m["train/grad_norm"] > 0, m
