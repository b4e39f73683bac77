"""MoE routing replay (--use-rollout-routing-replay, --use-routing-replay) on the tiny GLM-5 checkpoint, in one
process: the embedded engine returns the experts its routers chose per token (SGLang's meta_info
"routed_experts"), and the trainer routes exactly so even after its routers changed."""

import pytest
import torch
from replay_helpers import all_log_probs, max_diff

from slime.config.arguments import parse_args

PROMPTS = [[5, 9, 11, 40], [7, 7, 30], [100, 3, 8, 21, 60], [12, 13]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5"))


@pytest.fixture(scope="module")
def actor(tiny_ckpt):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    args = parse_args(["--hf-checkpoint", tiny_ckpt, "--num-rollout", "1", "--global-batch-size", "4",
                       "--micro-batch-size", "2", "--lr", "1e-3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                       "--use-rollout-routing-replay"])
    assert args.use_routing_replay and (args.num_layers, args.moe_router_topk) == (3, 2)  # from config.json
    actor = MegatronTrainRayActor(1, 0)
    actor.init(args)
    return actor


@pytest.fixture(scope="module")
def rollout(tiny_ckpt, actor):
    """Four samples from the embedded engine (one batched /generate over HTTP, as the rollout sends it) with their
    routed experts, through Sample and the trainer payload."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples
    from slime.utils.http_client import EngineClient
    from slime.utils.types import Sample

    engine = EmbeddedEngine(EngineConfig(model_path=tiny_ckpt, batch_wait_s=0.05))
    server = EngineHTTPServer(engine, "t", 0)
    server.start_in_thread()
    try:
        params = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
                  for i in range(len(PROMPTS))]
        outs = EngineClient(server.url, "t").generate(PROMPTS, params, return_logprob=True, return_routed_experts=True)
    finally:
        server.stop()
        engine.shutdown()
    samples = []
    for i, (p, out) in enumerate(zip(PROMPTS, outs)):
        s = Sample(index=i, tokens=list(p), reward=float(i % 2))
        pairs = out["meta_info"]["output_token_logprobs"]
        s.append_response_tokens(actor.args, tokens=[x[1] for x in pairs], log_probs=[x[0] for x in pairs],
                                 meta_info=out["meta_info"])
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, 3, 2)
        assert not s.rollout_routed_experts[:, 0].any() and s.rollout_routed_experts[:, 1:].max() < 8  # dense layer 0
        samples.append(s)
    return samples, batch_from_payload(pack_samples(samples))


def _moe_layers(actor):
    from slime_plugins.models.common.moe import MoELayer

    return [m for m in actor.model.modules() if isinstance(m, MoELayer)]


def _log_probs(actor, batch, replay):
    from contextlib import nullcontext

    from slime.utils.routing_replay import REPLAY

    with REPLAY.replaying("rollout", batch) if replay else nullcontext():
        return all_log_probs(actor, batch)


def test_changed_router_bias_still_routes_as_the_engine(actor, rollout):
    """The expert bias steers only the choice (the gate weights are the unbiased scores): with replay the trainer's
    log-probs equal the engine's after the bias changed; routing by itself they do not."""
    _, batch = rollout
    layers = _moe_layers(actor)
    saved = [m.expert_bias.clone() for m in layers]
    before = _log_probs(actor, batch, replay=True)
    assert max_diff(before, batch.rollout_log_probs) < 1e-4  # same weights: the engine's values
    try:
        for m in layers:  # experts 6 and 7 (group 2) win every choice
            m.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))
        replayed = _log_probs(actor, batch, replay=True)
        own = _log_probs(actor, batch, replay=False)
    finally:
        for m, b in zip(layers, saved):
            m.expert_bias.copy_(b)
    assert max_diff(replayed, batch.rollout_log_probs) < 1e-4
    assert max_diff(own, batch.rollout_log_probs) > 1e-2  # measured ~0.5: routing by itself differs


def test_changed_router_weights_route_every_token_as_the_engine(actor, rollout, monkeypatch):
    """Router weights scrambled: every fed token (all but each sample's last) goes to the engine's experts in
    every MoE layer; the gate weights are the new router's scores there (router grads still flow)."""
    from slime_plugins.models.common.moe import MoELayer

    samples, batch = rollout
    seen = {}
    original = MoELayer.route

    def spy(self, x):
        w, ids = original(self, x)
        seen.setdefault(self.replay_layer, []).append(ids.detach().cpu())
        return w, ids

    monkeypatch.setattr(MoELayer, "route", spy)
    layers = _moe_layers(actor)
    saved = [m.router_weight.detach().clone() for m in layers]
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in layers:
                m.router_weight.copy_(torch.randn(m.router_weight.shape, generator=gen))
        _log_probs(actor, batch, replay=True)
    finally:
        with torch.no_grad():
            for m, w in zip(layers, saved):
                m.router_weight.copy_(w)
    mbs = [[0, 1], [2, 3]]  # --micro-batch-size 2, in order
    for layer in (1, 2):
        for mb, ids in zip(mbs, seen[layer]):
            at = 0
            for i in mb:
                n = len(samples[i].tokens)
                want = samples[i].rollout_routed_experts[:, layer].sort(-1).values
                assert torch.equal(ids[at:at + n - 1].sort(-1).values, want.long()), (layer, i)
                at += n


def test_train_rollout_replays_in_both_forwards(actor, rollout):
    """The whole trainer path (payload -> old log-probs -> training forward with grad): with the bias changed,
    the old log-probs still equal the engine's (train_rollout_logprob_abs_diff ~1e-6); without the flag not."""
    from slime.backends.megatron.rollout_data import pack_samples

    samples, _ = rollout
    args = actor.args
    layers = _moe_layers(actor)
    saved = [m.expert_bias.clone() for m in layers]
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    diffs = {}
    try:
        for flag in (True, False):
            for m in layers:
                m.expert_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))
            args.use_rollout_routing_replay = args.use_routing_replay = flag
            m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
            diffs[flag] = m["train_rollout_logprob_abs_diff_max"]
            assert m["train/grad_norm"] > 0
            actor.model.load_state_dict(weights, strict=False)
    finally:
        args.use_rollout_routing_replay = args.use_routing_replay = True
        for m, b in zip(layers, saved):
            m.expert_bias.copy_(b)
    assert diffs[True] < 1e-4 and diffs[False] > 1e-2, diffs


def test_use_routing_replay_records_the_old_pass_for_the_training_pass(actor, rollout):
    """--use-routing-replay alone: the old-policy pass records its routes (packed as the training pass packs);
    replayed after the bias changed, the log-probs are the recorded pass's exactly."""
    from slime.utils.routing_replay import REPLAY, RoutingReplayError

    _, batch = rollout
    everything = list(range(len(batch)))
    with REPLAY.recording():
        recorded = actor._log_probs_of(batch, everything)
    layers = _moe_layers(actor)
    saved = [m.expert_bias.clone() for m in layers]
    try:
        for m in layers:
            m.expert_bias.copy_(torch.tensor([0, 0, 0, 5.0, 5.0, 0, 0, 0]))
        with REPLAY.replaying("recorded"):
            replayed = actor._log_probs_of(batch, everything)
        own = actor._log_probs_of(batch, everything)
        with pytest.raises(RoutingReplayError, match="was not recorded"), REPLAY.replaying("recorded"):
            actor._log_probs_of(batch, [0, 2])  # other micro-batches than the recorded pass's
    finally:
        for m, b in zip(layers, saved):
            m.expert_bias.copy_(b)
        REPLAY.recorded = {}
    assert all(torch.equal(recorded[i], replayed[i]) for i in everything)
    assert max(float((recorded[i] - own[i]).abs().max()) for i in everything) > 1e-2


def test_flags_refuse_a_dense_model(tmp_path, capsys):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path / "dense"), "qwen3")
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", path, "--num-rollout", "1", "--global-batch-size", "2", "--use-routing-replay"])
    assert "describes a dense model" in capsys.readouterr().err


def test_activation_recompute_replays_the_same_routes(actor, rollout):
    """Full recompute re-runs each layer's forward in backward: it must route as that micro-batch's first forward
    did. With the bias changed (the routers alone would pick other experts) the step's loss and grad norm equal
    those without recompute."""
    from slime.backends.megatron.hf_export import unwrap
    from slime.backends.megatron.rollout_data import pack_samples

    samples, _ = rollout
    config = unwrap(actor.model).config
    layers = _moe_layers(actor)
    saved = [m.expert_bias.clone() for m in layers]
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    runs = {}
    try:
        for granularity in (None, "full"):
            config.recompute_granularity, config.recompute_method, config.recompute_num_layers = \
                granularity, "uniform" if granularity else None, 1 if granularity else None
            for m in layers:
                m.expert_bias.copy_(torch.tensor([0, 0, 5.0, 5.0, 0, 0, 0, 0]))
            runs[granularity] = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
            actor.model.load_state_dict(weights, strict=False)
    finally:
        config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
        for m, b in zip(layers, saved):
            m.expert_bias.copy_(b)
    plain, recomputed = runs[None], runs["full"]
    assert recomputed["train_rollout_logprob_abs_diff_max"] < 1e-4
    for key in ("train/loss", "train/grad_norm"):
        assert abs(plain[key] - recomputed[key]) <= 1e-6 * max(1.0, abs(plain[key])), (key, plain[key], recomputed[key])


@pytest.mark.timeout(600)
def test_replay_at_tp2_cp2_ep2_routes_as_the_engine(tiny_ckpt, rollout, tmp_path):
    """Each rank's MoE layers see their slice of the packed tokens (TP2: sequence parallel; CP2: the rank's
    chunks; EP2: all tokens, half the experts): replayed, the log-probs are the engine's; by themselves not."""
    from glm5_helpers import spawn_ranks
    from routing_replay_parallel_worker import run

    from slime.backends.megatron.rollout_data import pack_samples

    samples, batch = rollout
    path = str(tmp_path / "rollout.pt")
    torch.save(pack_samples(samples), path)
    names = ["tp2", "cp2", "ep2"]
    spawn_ranks(run, 2, tiny_ckpt, path, str(tmp_path), names)
    for name in names:
        got = torch.load(tmp_path / f"{name}.pt")
        assert max_diff(got[True], batch.rollout_log_probs) < 1e-4, name
        assert max_diff(got[False], batch.rollout_log_probs) > 1e-2, name


def steer_experts_before_training(args, rollout_id, step_id, model, optimizer, scheduler):
    """A train-step hook that changes the routers' choice between the old-policy pass and the training forward."""
    for m in _moe_layers_of(model):
        m.expert_bias.copy_(torch.tensor([0, 5.0, 0, 0, 0, 5.0, 0, 0]))


def _moe_layers_of(model):
    from slime_plugins.models.common.moe import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def test_use_routing_replay_trains_on_the_old_passs_routes(actor, rollout):
    """--use-routing-replay alone through train_rollout: the routers change between the old-policy pass and the
    training forward (a before-train-step hook moves the expert bias); replayed, the training forward's
    log-probs are the old pass's (ppo_kl 0 to rounding); routing by itself the policy seems to have moved."""
    from slime.backends.megatron.rollout_data import pack_samples
    from slime.utils.routing_replay import REPLAY

    samples, _ = rollout
    args = actor.args
    layers = _moe_layers(actor)
    saved = [m.expert_bias.clone() for m in layers]
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    kl = {}
    try:
        args.use_rollout_routing_replay = False
        args.custom_megatron_before_train_step_hook_path = "tests.test_routing_replay:steer_experts_before_training"
        for flag in (True, False):
            args.use_routing_replay = flag
            m = actor.train_rollout(0, pack_samples(samples), reuse_train_log_probs=False)
            kl[flag] = abs(m["train/ppo_kl"])
            assert not REPLAY.recorded  # cleared after the rollout
            actor.model.load_state_dict(weights, strict=False)
            for layer, b in zip(layers, saved):
                layer.expert_bias.copy_(b)
    finally:
        args.custom_megatron_before_train_step_hook_path = None
        args.use_rollout_routing_replay = args.use_routing_replay = True
        for layer, b in zip(layers, saved):
            layer.expert_bias.copy_(b)
    assert kl[True] < 1e-6 and kl[False] > 1e-3, kl


FAMILIES = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Per family: a tiny checkpoint, four samples from the embedded engine with their routed experts, and what one
    spawned trainer rank (shared by the families, one after the other) saw replaying them and routing alone."""
    from glm5_helpers import spawn_ranks
    from routing_replay_parallel_worker import run_families

    from slime.backends.embedded.engine import EmbeddedEngine, EngineConfig
    from slime.backends.megatron.rollout_data import pack_samples
    from slime.config.rollout_args import rollout_defaults
    from slime.utils.types import Sample
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("families")
    items, all_samples = [], {}
    for model_type in FAMILIES:
        ckpt = write_tiny_checkpoint(str(d / model_type), model_type)
        engine = EmbeddedEngine(EngineConfig(model_path=ckpt, batch_wait_s=0.05))
        try:
            reqs = [engine.submit(engine.make_request(p, {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": i,
                                                          "ignore_eos": True}, True, return_routed_experts=True))
                    for i, p in enumerate(PROMPTS)]
            outs = [(r.done.wait(), engine.response(r))[1] for r in reqs]
            layers, topk = engine._routes.num_layers, engine._routes.top_k
        finally:
            engine.shutdown()
        args = rollout_defaults(num_layers=layers, moe_router_topk=topk)
        samples = []
        for i, (p, out) in enumerate(zip(PROMPTS, outs)):
            s = Sample(index=i, tokens=list(p), reward=0.0)
            pairs = out["meta_info"]["output_token_logprobs"]
            s.append_response_tokens(args, tokens=[x[1] for x in pairs], log_probs=[x[0] for x in pairs],
                                     meta_info=out["meta_info"])
            samples.append(s)
        payload = str(d / f"{model_type}_payload.pt")
        torch.save(pack_samples(samples), payload)
        items.append((model_type, ckpt, payload))
        all_samples[model_type] = samples
    spawn_ranks(run_families, 1, items, str(d))
    return {m: (all_samples[m], torch.load(d / f"{m}.pt")) for m in FAMILIES}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_other_moe_families_replay_the_engines_routes(model_type, families):
    """Qwen3-MoE (softmax router) and DeepSeek-V3 (sigmoid, expert groups): the engine's routed experts, replayed
    by the trainer (one spawned rank for both families), give the engine's log-probs; with the router weights
    scrambled every fed token still goes to the engine's experts, and by themselves the routers choose others."""
    samples, got = families[model_type]
    assert max_diff(got["replayed"], [s.rollout_log_probs for s in samples]) < 1e-4
    moe = sorted(k for k in got["ids"][True] if k is not None)
    assert moe, "no MoE layer replayed"
    differs = 0
    for layer in moe:
        at = 0
        for s in samples:
            n = len(s.tokens)
            mine = got["ids"][True][layer][at:at + n - 1].sort(-1).values
            assert torch.equal(mine, s.rollout_routed_experts[:, layer].sort(-1).values.long()), (layer, s.index)
            differs += int(not torch.equal(got["ids"][False][layer][at:at + n - 1].sort(-1).values, mine))
            at += n
    assert differs > 0  # the scrambled routers alone pick other experts


def test_sample_reads_routed_experts_as_upstream():
    """meta_info["routed_experts"]: base64 int32 rows of the fed tokens from routed_experts_start_len on (earlier
    rows kept); an aborted turn's are dropped (its continuation returns every row); a wrong count is one error."""
    import base64

    import numpy as np

    from slime.config.rollout_args import rollout_defaults
    from slime.utils.types import Sample

    args = rollout_defaults(num_layers=2, moe_router_topk=2)

    def meta(rows, start=0, finish="stop"):
        data = base64.b64encode(np.asarray(rows, dtype=np.int32).tobytes()).decode()
        return {"routed_experts": data, "routed_experts_start_len": start, "finish_reason": {"type": finish}}

    s = Sample(index=0, tokens=[1, 2, 3])
    first = np.arange(4 * 4).reshape(4, 2, 2) % 5  # prompt 3 + 2 new tokens -> 4 fed rows
    s.append_response_tokens(args, tokens=[4, 5], log_probs=[-0.1, -0.2], meta_info=meta(first))
    assert s.rollout_routed_experts.tolist() == first.tolist()
    later = np.full((1, 2, 2), 7)  # a second turn of 1 token: 5 rows fed in all, the engine reports rows 4 on
    s.append_response_tokens(args, tokens=[6], log_probs=[-0.3], meta_info=meta(later, start=4))
    assert s.rollout_routed_experts.tolist() == first.tolist() + later.tolist()
    cut = Sample(index=1, tokens=[1, 2, 3])
    cut.append_response_tokens(args, tokens=[], log_probs=[], meta_info=meta(np.zeros((0, 2, 2)), finish="abort"))
    assert cut.rollout_routed_experts is None and cut.status == Sample.Status.ABORTED
    with pytest.raises(ValueError, match="routed_experts has 8 values, expected 4 tokens x 2 layers x top-2"):
        Sample(index=2, tokens=[1, 2, 3]).append_response_tokens(args, tokens=[4, 5], log_probs=[-0.1, -0.2],
                                                                 meta_info=meta(first[:2]))


def test_rollout_routing_replay_sends_generation_to_the_engines(tiny_ckpt, capsys):
    """sglang-router 0.3 drops return_routed_experts from /generate bodies: the flag routes in-process (auto), and
    an explicit --rollout-router sglang-router is refused in one line; --use-routing-replay alone keeps the router."""
    base = ["--hf-checkpoint", tiny_ckpt, "--num-rollout", "1", "--global-batch-size", "4"]
    assert parse_args([*base, "--use-rollout-routing-replay"]).rollout_router == "in-process"
    assert parse_args([*base, "--use-routing-replay"]).rollout_router == "auto"
    with pytest.raises(SystemExit):
        parse_args([*base, "--use-rollout-routing-replay", "--rollout-router", "sglang-router"])
    assert "sglang-router 0.3 drops return_routed_experts" in capsys.readouterr().err


def test_sglang_engines_are_started_to_return_routed_experts():
    """As upstream's engine start: SGLang records the routers' choices only with --enable-return-routed-experts
    (a reserved option: the run sets it, users do not)."""
    from slime.config.rollout_args import rollout_defaults, sglang_passthrough

    assert "--enable-return-routed-experts" in sglang_passthrough(rollout_defaults(use_rollout_routing_replay=True))
    assert "--enable-return-routed-experts" not in sglang_passthrough(rollout_defaults())


def test_rows_as_packed_lays_out_each_samples_fed_tokens():
    """The layout routing and indexer top-k replay share (routing_replay.rows_as_packed): a sample's rows at its
    tokens but the last, `fill` at its last token, at a one-token sample and at the padding; under context
    parallel only this rank's tokens; rows of another shape refused through the caller's error."""
    from types import SimpleNamespace

    from slime.utils.routing_replay import rows_as_packed

    tokens = [[1, 2, 3], [4], [5, 6]]
    rows = [torch.tensor([[[1, 2]], [[3, 4]]]), torch.zeros(0, 7, 9), torch.tensor([[[5, 6]]])]
    mb = SimpleNamespace(sample_indices=[0, 1, 2], tokens=torch.zeros(1, 8), cp=None,
                         cu_seqlens=torch.tensor([0, 3, 4, 6]))

    def misfit(i, shape, n):
        return ValueError(f"sample {i}: {shape} for {n} tokens")

    ids, valid = rows_as_packed(rows, tokens, mb, (1, 2), -1, misfit)
    assert ids.dtype == torch.int32 and ids[:, 0].tolist() == [[1, 2], [3, 4], [-1, -1], [-1, -1], [5, 6]] + \
        [[-1, -1]] * 3
    assert valid.tolist() == [True, True, False, False, True, False, False, False]
    mb.cp = SimpleNamespace(local_index=torch.tensor([1, 4, 7]))
    ids, valid = rows_as_packed(rows, tokens, mb, (1, 2), 0, misfit)
    assert ids[:, 0].tolist() == [[3, 4], [5, 6], [0, 0]] and valid.tolist() == [True, True, False]
    with pytest.raises(ValueError, match=r"^sample 2: \(1, 1, 3\) for 2 tokens$"):
        rows_as_packed([rows[0], rows[1], torch.zeros(1, 1, 3)], tokens, mb, (1, 2), -1, misfit)
    with pytest.raises(ValueError, match=r"^sample 0: \(3, 1, 2\) for 3 tokens$"):
        rows_as_packed([torch.zeros(3, 1, 2), rows[1], rows[2]], tokens, mb, (1, 2), -1, misfit)
