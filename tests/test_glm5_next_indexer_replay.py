"""DSA indexer top-k replay (--use-rollout-indexer-replay) on the tiny GLM-5.3-Flash (glm5_next_text: KDA, KDA, DSA
"full", DSA "shared", KDA; index_topk 8 over k-pools of 4, so the 12-20 token sequences here drop keys), in one
process: the embedded engine returns the keys its DSA layers attended over per token (SGLang's
meta_info["indexer_topk"]), through Sample and the trainer payload, and the trainer's DSA layers use exactly
those. Tolerances: log-probs within 1e-5 of the engine's (measured 4.8e-7; 0.098 without replay once the
selections differ); selections equal."""

import base64

import numpy as np
import pytest
import torch
from replay_helpers import all_log_probs, max_diff

from slime.config.arguments import parse_args

PROMPTS = [[5, 9, 11, 40, 3, 8, 21, 60, 77, 90, 14, 33], [7, 7, 30, 101, 102, 5, 6, 9, 200],
           [100, 3, 8, 21, 60, 4, 4, 4, 250, 251, 252, 253, 254, 12], [12, 13, 400]]
NEW = 6
LAYERS, WIDTH = 5, 8 + 4 - 1  # num_hidden_layers; index_topk + index_kpool - 1 (always_select_tail)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5_next"), "glm5_next_text", seed=3)


@pytest.fixture(scope="module")
def actor(tiny_ckpt):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    args = parse_args(["--hf-checkpoint", tiny_ckpt, "--num-rollout", "1", "--global-batch-size", "4",
                       "--micro-batch-size", "2", "--lr", "1e-3", "--rollout-batch-size", "2",
                       "--n-samples-per-prompt", "2", "--use-rollout-indexer-replay"])
    assert args.num_layers == LAYERS and args.rollout_router == "in-process"
    actor = MegatronTrainRayActor(1, 0)
    actor.init(args)
    return actor


def _engine_rollout(tiny_ckpt, change_engine=None, routed_experts=False):
    """The engine's answers to PROMPTS (one batched /generate over HTTP, as the rollout sends it); with
    `routed_experts` the MoE routes too."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.utils.http_client import EngineClient

    engine = EmbeddedEngine(EngineConfig(model_path=tiny_ckpt, batch_wait_s=0.05))
    if change_engine is not None:
        change_engine(engine.model)
    server = EngineHTTPServer(engine, "t", 0)
    server.start_in_thread()
    try:
        params = [{"max_new_tokens": NEW, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
                  for i in range(len(PROMPTS))]
        return EngineClient(server.url, "t").generate(PROMPTS, params, return_logprob=True, return_indexer_topk=True,
                                                     return_routed_experts=routed_experts)
    finally:
        server.stop()
        engine.shutdown()


def _samples(args, outs):
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples
    from slime.utils.types import Sample

    samples = []
    for i, (p, out) in enumerate(zip(PROMPTS, outs)):
        s = Sample(index=i, tokens=list(p), reward=float(i % 2))
        pairs = out["meta_info"]["output_token_logprobs"]
        s.append_response_tokens(args, tokens=[x[1] for x in pairs], log_probs=[x[0] for x in pairs],
                                 meta_info=out["meta_info"])
        samples.append(s)
    return samples, batch_from_payload(pack_samples(samples))


@pytest.fixture(scope="module")
def rollout(tiny_ckpt, actor):
    return _samples(actor.args, _engine_rollout(tiny_ckpt))


def _perturb_indexers(model, scale=3.0, seed=0):
    """Random indexer weights (query, gate): the selections change, nothing else does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name and name.endswith(("wq_b.weight", "index_kpool_compress_gate", "wk.weight")):
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _log_probs(actor, batch, replay):
    from contextlib import nullcontext

    from slime.utils.indexer_replay import INDEXER_REPLAY

    with INDEXER_REPLAY.replaying(batch) if replay else nullcontext():
        return all_log_probs(actor, batch)


def _trainer_selections(actor, tokens):
    """The trainer's own selection of each DSA layer for one unpacked sequence: {layer: int32 [n, width]}."""
    from slime.backends.megatron.hf_export import unwrap
    from slime_plugins.models.glm5_next.attention import NopeMlaDsaAttention

    model, seen, hooks = unwrap(actor.model), {}, []
    for m in model.modules():
        if isinstance(m, NopeMlaDsaAttention):
            hooks.append(m.register_forward_hook(
                lambda mod, a, kw, out: seen.update({mod.layer_index: kw["packed_seq_params"].topk.get(mod.topk_source)}),
                with_kwargs=True))
    try:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            model(ids, torch.arange(len(tokens))[None])
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_engine_records_the_trainers_selection_and_replay_matches_its_log_probs(actor, rollout):
    """(a) Same weights: every recorded row of the full layer (2) equals the trainer's own selection, the shared
    layer's slot (3) mirrors it, KDA slots are -1; with replay the trainer's log-probs equal the engine's (1e-5)."""
    samples, batch = rollout
    for s in samples:
        rows = torch.as_tensor(s.rollout_indexer_topk)
        assert rows.shape == (len(s.tokens) - 1, LAYERS, WIDTH)
        assert torch.equal(rows[:, 3], rows[:, 2]) and bool((rows[:, [0, 1, 4]] == -1).all())
        mine = _trainer_selections(actor, s.tokens)
        if len(s.tokens) <= WIDTH:  # the trainer attends densely (ops' rule); the engine then selects every key
            assert [sorted(x for x in r.tolist() if x >= 0) for r in rows[:, 2]] == \
                [list(range(t + 1)) for t in range(len(s.tokens) - 1)]
            continue
        assert torch.equal(mine[2][: len(s.tokens) - 1].to(torch.int32), rows[:, 2])
        assert torch.equal(mine[3], mine[2])
    assert max(len(s.tokens) for s in samples) > WIDTH  # some queries drop keys: the selection matters
    diff = max_diff(_log_probs(actor, batch, replay=True), batch.rollout_log_probs)
    assert diff <= 1e-5, diff


def test_replay_uses_the_rollouts_selection_after_the_trainers_indexer_changed(actor, rollout):
    """(b) The trainer's indexer weights changed (its own selections differ from the engine's): with replay its
    log-probs still equal the engine's (1e-5), without replay they do not (> 1e-3)."""
    samples, batch = rollout
    from slime.backends.megatron.hf_export import unwrap

    model = unwrap(actor.model)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items() if ".indexer." in k}
    try:
        _perturb_indexers(model)
        changed = sum(int((_trainer_selections(actor, s.tokens)[2][: len(s.tokens) - 1].to(torch.int32)
                           != torch.as_tensor(s.rollout_indexer_topk)[:, 2]).any(-1).sum())
                      for s in samples if len(s.tokens) > WIDTH)
        assert changed > 0  # the trainer would now attend over other keys
        replayed = max_diff(_log_probs(actor, batch, replay=True), batch.rollout_log_probs)
        own = max_diff(_log_probs(actor, batch, replay=False), batch.rollout_log_probs)
    finally:
        model.load_state_dict(saved, strict=False)
    assert replayed <= 1e-5 and own > 1e-3, (replayed, own)


def test_engine_side_change_is_replayed_in_both_training_passes(tiny_ckpt, actor):
    """(b) The engine's indexer changed instead: train_rollout (payload -> old log-probs -> training forward with
    grad) with the flag keeps the train/rollout log-prob gap at rounding; without the flag it is large."""
    from slime.backends.megatron.rollout_data import pack_samples

    samples, _ = _samples(actor.args, _engine_rollout(tiny_ckpt, _perturb_indexers))
    args = actor.args
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    diffs = {}
    try:
        for flag in (True, False):
            args.use_rollout_indexer_replay = flag
            m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
            diffs[flag] = m["train_rollout_logprob_abs_diff_max"]
            assert m["train/grad_norm"] > 0
            actor.model.load_state_dict(weights, strict=False)
    finally:
        args.use_rollout_indexer_replay = True
    assert diffs[True] <= 1e-5 and diffs[False] > 1e-3, diffs


def test_payload_layout_and_meta_info_parsing(actor, rollout):
    """(c) meta_info["indexer_topk"] is SGLang's wire form (base64 int32, C order) of [len - 1, layers, width]
    rows; the sample, the trainer payload and the micro-batch layout keep them; an aborted turn's are dropped
    and a count that is no multiple of rows x layers is one error."""
    from types import SimpleNamespace

    from slime.utils.indexer_replay import INDEXER_REPLAY
    from slime.utils.types import Sample

    samples, batch = rollout
    rows = np.asarray(samples[0].rollout_indexer_topk, dtype=np.int32)
    wire = base64.b64encode(rows.tobytes()).decode()
    decoded = np.frombuffer(base64.b64decode(wire), dtype=np.int32)  # as SGLang's extract_indexer_topk_from_meta_info
    assert decoded.reshape(len(samples[0].tokens) - 1, LAYERS, -1).tolist() == rows.tolist()
    for s, b in zip(samples, batch.rollout_indexer_topk):
        assert torch.equal(torch.as_tensor(s.rollout_indexer_topk), b)
    prompt = samples[0].tokens[:-NEW]
    s = Sample(index=9, tokens=list(prompt))
    s.append_response_tokens(actor.args, tokens=samples[0].tokens[-NEW:], log_probs=[-0.1] * NEW,
                             meta_info={"indexer_topk": wire, "finish_reason": {"type": "length"}})
    assert s.rollout_indexer_topk.tolist() == rows.tolist()
    cut = Sample(index=10, tokens=list(prompt))
    cut.append_response_tokens(actor.args, tokens=[], log_probs=[],
                               meta_info={"indexer_topk": wire, "finish_reason": {"type": "abort"}})
    assert cut.rollout_indexer_topk is None
    with pytest.raises(ValueError, match="not a multiple of"):
        Sample(index=11, tokens=list(prompt)).append_response_tokens(
            actor.args, tokens=[1], log_probs=[-0.1], meta_info={"indexer_topk": wire})
    lengths = [len(t) for t in batch.tokens[1:3]]
    mb = SimpleNamespace(sample_indices=[1, 2], tokens=torch.zeros(1, sum(lengths) + 3), cp=None,
                         cu_seqlens=torch.tensor([0, lengths[0], sum(lengths)]))
    with INDEXER_REPLAY.replaying(batch):
        ids, valid = INDEXER_REPLAY.selection(mb)
    assert INDEXER_REPLAY.selection(mb) is None  # off outside the pass
    assert valid.tolist() == [True] * (lengths[0] - 1) + [False] + [True] * (lengths[1] - 1) + [False] * 4
    assert torch.equal(ids[lengths[0]:lengths[0] + lengths[1] - 1], batch.rollout_indexer_topk[2])


def test_client_asks_for_indexer_topk_as_sglang_names_it(monkeypatch):
    from slime.utils.http_client import EngineClient

    sent = {}
    client = EngineClient("http://127.0.0.1:1", "t")
    monkeypatch.setattr(client, "post", lambda path, body, timeout=None: sent.update(body) or {})
    client.generate([1, 2], {}, return_indexer_topk=True)
    assert sent["return_indexer_topk"] is True and "return_routed_experts" not in sent


@pytest.mark.parametrize("evaluation", [False, True])
def test_only_training_rollouts_ask_for_indexer_topk(evaluation):
    """Evaluation never trains on the selection (~371 KB per token at full size): its requests do not ask for it;
    routing replay's field is asked for in both, as upstream's generate does."""
    from types import SimpleNamespace

    from slime.config.arguments import build_parser
    from slime.rollout.generate import _Sender, _WorkQueue

    args = build_parser().parse_args([])
    args.use_rollout_indexer_replay = args.use_rollout_routing_replay = True
    sender = _Sender(args, fleet=SimpleNamespace(), queue=_WorkQueue([], 1), custom=None, behind_router=False,
                     tokenizer=None, reward_fn=None, counters=None, engine_times=None, evaluation=evaluation,
                     extra_params=None)
    assert sender.routed.get("return_routed_experts") is True
    assert sender.routed.get("return_indexer_topk") is (None if evaluation else True)


def test_flag_refuses_what_cannot_replay(tmp_path, tiny_ckpt, capsys):
    """(d) One line, exit 2, before Ray: a model without GLM-5.3-Flash's DSA layers, SGLang engines, sglang-router."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    base = ["--num-rollout", "1", "--global-batch-size", "2", "--use-rollout-indexer-replay"]
    path = write_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    cases = [(["--hf-checkpoint", path], "model_type 'qwen3'"),
             (["--hf-checkpoint", tiny_ckpt, "--rollout-engine", "sglang"], "SGLang 0.5.23 does not capture"),
             (["--hf-checkpoint", tiny_ckpt, "--rollout-router", "sglang-router"], "drops return_indexer_topk"),
             (["--hf-checkpoint", str(tmp_path)], "needs the model's config.json")]
    capsys.readouterr()  # the checkpoint writer's progress
    for extra, words in cases:
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert not parse_args(["--hf-checkpoint", tiny_ckpt, "--num-rollout", "1", "--global-batch-size", "2"]
                          ).use_rollout_indexer_replay  # off by default


def test_replay_at_tp2_cp2_pp2_ep2_and_under_recompute_uses_the_engines_selection(tiny_ckpt, rollout, tmp_path):
    """TP2 (sequence parallel), CP2 (each rank's chunks select over their sequences' prefixes), PP2 (layers split
    2 + 3: both DSA layers on the second stage, which indexes the payload by global layer) and EP2, the trainer's
    indexer changed: replayed, the log-probs are the engine's (1e-5; measured 4.8e-7 in each layout); selecting
    by themselves not (> 1e-3; 0.098). DP2 with full activation recompute: the training forward's (with grad,
    layers recomputed in backward) too."""
    from glm5_helpers import spawn_ranks
    from indexer_replay_parallel_worker import run

    from slime.backends.megatron.rollout_data import pack_samples

    samples, batch = rollout
    path = str(tmp_path / "rollout.pt")
    torch.save(pack_samples(samples), path)
    names = ["tp2", "cp2", "pp2", "ep2", "recompute"]
    spawn_ranks(run, 2, tiny_ckpt, path, str(tmp_path), names)
    gaps = torch.load(tmp_path / "recompute.pt")
    assert gaps[True] <= 1e-5 and gaps[False] > 1e-3, gaps
    for name in names[:-1]:
        got = torch.load(tmp_path / f"{name}.pt")
        assert max_diff(got[True], batch.rollout_log_probs) <= 1e-5, name
        assert max_diff(got[False], batch.rollout_log_probs) > 1e-3, name
    assert torch.load(tmp_path / "pp2.pt")["dsa_layers"] == [[], [2, 3]]  # the selection reaches the second stage
