"""Rollout pieces without Ray: synthetic task, rewards, data source, router, generate_rollout with failures."""

from __future__ import annotations

import json
import threading

import pytest

from slime.config.rollout_args import rollout_defaults, sglang_passthrough
from slime.rollout.data_source import DataSourceError, JsonlDataSource
from slime.rollout.generate import EngineFleet, RolloutError, generate_rollout, sample_seed, sampling_params
from slime.rollout.rewards import RewardError, compute_reward, get_reward_fn, load_custom, reward_value
from slime.rollout.router import NoEngineAvailable, Router
from slime.rollout.sample import Sample, SampleStatus
from slime.rollout.synthetic import ALPHABET, W_ALPHABET, W_POSITION, W_STOP, make_dataset, score, synthetic_reward
from slime.utils.http_client import EngineUnreachable


@pytest.fixture(scope="module")
def tokenizer():
    from slime.utils.tiny_tokenizer import build_tokenizer

    return build_tokenizer(512)


# ------------------------------------------------------------------ synthetic task
def test_synthetic_dataset_cli_and_labels(tmp_path, tokenizer):
    from slime.rollout.synthetic import main

    out = tmp_path / "d.jsonl"
    main(["--out", str(out), "--num", "50", "--seed", "3", "--tasks", "copy,reverse", "--min-len", "2", "--max-len", "4"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 50 and rows == make_dataset(50, 3, ("copy", "reverse"), 2, 4)
    for r in rows:
        task, _, rest = r["prompt"].partition(" : ")
        symbols = rest.removesuffix(" =").split()
        assert 2 <= len(symbols) <= 4 and set(symbols) <= set(ALPHABET)
        assert r["label"].split() == (symbols if task == "copy" else symbols[::-1])
        # one token per symbol: the reward can be checked exactly
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        assert len(ids) == len(symbols) + 3 and tokenizer.unk_token_id not in ids


@pytest.mark.parametrize("response, label, expected", [
    ("c a d", "c a d", 1.0),
    ("c a d e", "c a d", W_ALPHABET + W_POSITION),  # right symbols, did not stop
    ("d a c", "c a d", W_ALPHABET + W_POSITION / 3 + W_STOP),
    ("e e e", "c a d", W_ALPHABET + W_STOP),
    ("<extra_5> a <extra_9> b", "c a d", W_ALPHABET / 3 + W_POSITION / 3),
    ("", "c a d", 0.0),
    ("<extra_1> <extra_2> <extra_3> <extra_4>", "c a d", 0.0),
])
def test_synthetic_score_partial_credit(response, label, expected):
    assert score(response, label) == pytest.approx(expected, abs=1e-12)


def test_synthetic_reward_has_variance_at_random_init():
    """The shaped reward is what lets GRPO start: random 512-way tokens must hit the alphabet sometimes."""
    import random

    rng = random.Random(0)
    vocab = list(ALPHABET) + [f"<extra_{i}>" for i in range(512 - len(ALPHABET))]
    rewards = [score(" ".join(rng.choice(vocab) for _ in range(8)), "c a d b") for _ in range(4000)]
    nonzero = sum(r > 0 for r in rewards) / len(rewards)
    assert 0.02 < nonzero < 0.1  # ~4 positions x 5/512: some groups of 8 get signal
    s = Sample(group_index=0, index=0, prompt="p", label="c a d", response="c a d", status=SampleStatus.TRUNCATED)
    assert synthetic_reward(None, s) == pytest.approx(1.0 - W_STOP)


def test_synthetic_one_letter_answer_scores_the_quick_start_plateau():
    """The quick start's plateau (~0.35, docs/training.md): one repeated letter, whatever the prompt, never
    stopping. Its expected reward is the alphabet credit plus chance position credit, 0.2 + 0.7 / 5."""
    rows = make_dataset(4096, seed=0)
    for letter in ALPHABET:
        mean = sum(score(" ".join([letter] * 8), r["label"]) for r in rows) / len(rows)
        assert mean == pytest.approx(W_ALPHABET + W_POSITION / len(ALPHABET), abs=0.01)


# ------------------------------------------------------------------ rewards hub
@pytest.mark.parametrize("response, label, ok", [  # upstream's grade_answer_verl (tests/test_rm_hub.py: the table)
    ("so the answer is \\boxed{42}.", "42", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", True),
    ("The answer is: 1,234.", "1234", False),  # only a \\boxed{} answer counts
    ("we get 3 then 7", "7", False),
    ("\\boxed{x+1}", "x + 1", True),
    ("$\\boxed{-5}$", "-5", True),
    ("no number here", "5", False),
    ("\\boxed{12}", "13", False),
])
def test_math_exact_match(response, label, ok):
    args = rollout_defaults(rm_type="math")
    assert compute_reward(get_reward_fn(args), args, Sample(group_index=0, index=0, prompt="p", label=label, response=response)) == int(ok)


def test_reward_selection_and_custom_path():
    args = rollout_defaults(rm_type="math")
    s = Sample(group_index=0, index=0, prompt="p", label="4", response="2+2 = \\boxed{4}")
    assert compute_reward(get_reward_fn(args), args, s) == 1
    args = rollout_defaults(rm_type="math", custom_rm_path="slime.rollout.synthetic:synthetic_reward")
    assert get_reward_fn(args).__name__ == "synthetic_reward"
    assert load_custom("slime.rollout.rewards.math_reward").__name__ == "math_reward"
    for bad, needle in (("nodots", "package.module.function"), ("no_such_mod.fn", "cannot import"),
                        ("slime.rollout.rewards.nope", "no attribute")):
        with pytest.raises(RewardError, match=needle):
            load_custom(bad)
    with pytest.raises(RewardError, match="choose one of"):
        get_reward_fn(rollout_defaults(rm_type="bleu"))
    args = rollout_defaults(rm_type="dapo")  # a dict reward needs --reward-key
    s = Sample(group_index=0, index=7, prompt="p", label="4", response="Answer: 4")
    with pytest.raises(RewardError, match="sample 7: .*pass --reward-key"):
        compute_reward(get_reward_fn(args), args, s)
    args.reward_key = "score"
    assert compute_reward(get_reward_fn(args), args, s) == {"score": 1.0, "acc": True, "pred": "4"}
    assert reward_value({"score": -1.0, "acc": False}, "score") == -1.0
    with pytest.raises(RewardError, match="'acc' is not in"):
        reward_value({"score": 1.0}, "acc")


# ------------------------------------------------------------------ data source
def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_data_source_keys_chat_template_and_filter(tmp_path, tokenizer):
    rows = [{"q": f"copy : a {'b ' * i}=", "ans": f"a{i}", "metadata": {"i": i}} for i in range(6)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    ds = JsonlDataSource(path, tokenizer, input_key="q", label_key="ans", apply_chat_template=True, max_prompt_len=9)
    assert len(ds) == 4 and ds.dropped == 2  # chat template adds <|user|> and <|assistant|>
    item = ds.next_batch(1)[0]
    assert item.label == "a0" and item.metadata == {"i": 0}
    # the templated text is the sample's prompt, as upstream's
    assert item.prompt == "<|user|> copy : a = <|assistant|>" == tokenizer.decode(item.prompt_ids)
    plain = JsonlDataSource(path, tokenizer, input_key="q", label_key="ans")
    assert tokenizer.decode(plain.next_batch(1)[0].prompt_ids) == "copy : a ="


def test_data_source_epochs_shuffle_and_resume(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"copy : {c} =", "label": c} for c in "abcde"])
    ds = JsonlDataSource(path, tokenizer, shuffle=True, seed=7)
    first = [i.label for i in ds.next_batch(5)]
    second = [i.label for i in ds.next_batch(5)]
    assert sorted(first) == sorted(second) == list("abcde") and first != second  # each epoch reshuffled
    assert ds.epoch == 1 and [i.group_index for i in ds.next_batch(2)] == [10, 11]
    state = ds.state_dict()
    expected = [i.label for i in ds.next_batch(6)]
    resumed = JsonlDataSource(path, tokenizer, shuffle=True, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip (checkpoint)
    assert [i.label for i in resumed.next_batch(6)] == expected
    assert JsonlDataSource(path, tokenizer, shuffle=True, seed=7).next_batch(5)[0].label == first[0]  # seeded
    with pytest.raises(DataSourceError, match="another --rollout-seed"):
        JsonlDataSource(path, tokenizer, shuffle=True, seed=8).load_state_dict(state)
    small = _write_jsonl(tmp_path / "s.jsonl", [{"prompt": "copy : a =", "label": "a"}])
    with pytest.raises(DataSourceError, match="same --prompt-data"):
        JsonlDataSource(small, tokenizer, shuffle=True, seed=7).load_state_dict(state)


def test_data_source_bad_input_errors(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "copy : a ="}\n{not json}\n')
    with pytest.raises(DataSourceError, match=r"bad.jsonl:2 is not valid JSON"):
        JsonlDataSource(str(bad), tokenizer)
    with pytest.raises(DataSourceError, match="no key 'question'"):
        JsonlDataSource(_write_jsonl(tmp_path / "k.jsonl", [{"prompt": "x"}]), tokenizer, input_key="question")
    with pytest.raises(DataSourceError, match="cannot be read"):
        JsonlDataSource(str(tmp_path / "missing.jsonl"), tokenizer)
    chat = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "copy : a ="}]}])
    with pytest.raises(DataSourceError, match="--apply-chat-template"):
        JsonlDataSource(chat, tokenizer)
    assert JsonlDataSource(chat, tokenizer, apply_chat_template=True).next_batch(1)[0].prompt_ids


# ------------------------------------------------------------------ router
def test_router_least_outstanding_and_outages():
    r = Router(3)
    assert [r.acquire() for _ in range(4)] == [0, 1, 2, 0]
    r.release(1)
    assert r.acquire() == 1
    r.set_usable(0, False)
    r.set_usable(1, False)
    assert r.acquire() == 2 and r.outstanding == [2, 1, 2]
    r.set_usable(2, False)
    with pytest.raises(NoEngineAvailable):
        r.acquire(timeout=0.05)
    threading.Timer(0.05, r.set_usable, args=(1, True)).start()
    assert r.acquire(timeout=5) == 1  # waits for an engine to come back


def test_sampling_params_follow_flags():
    args = rollout_defaults(rollout_max_response_len=7, rollout_temperature=0.8, rollout_top_p=0.9, rollout_top_k=20,
                            rollout_stop_token_ids=[2, 5], rollout_seed=3)
    p = sampling_params(args, sample_seed(args, 11))
    assert (p["max_new_tokens"], p["temperature"], p["top_p"], p["top_k"], p["stop_token_ids"]) == (7, 0.8, 0.9, 20, [2, 5])
    assert p["sampling_seed"] == sample_seed(args, 11) != sample_seed(args, 12)
    args = rollout_defaults(sglang_mem_fraction_static=0.7, sglang_disable_cuda_graph=True,
                            sglang_server_args="--foo 1 --bar")
    assert sglang_passthrough(args) == ["--mem-fraction-static", "0.7", "--disable-cuda-graph", "--foo", "1", "--bar"]


# ------------------------------------------------------------------ generate_rollout with in-process engines
class _Fleet(EngineFleet):
    """Two in-process embedded engines; engine 1 'dies' (connection refused) on its first `fail` requests."""

    def __init__(self, clients, fail: int = 0, restarts_allowed: int = 5):
        self.clients, self.router = clients, Router(len(clients))
        self.gen = [0] * len(clients)
        self.fail, self.failures, self.restarts_allowed = fail, [], restarts_allowed
        self.lock = threading.Lock()
        self.sent: list[int] = []

    def acquire(self):
        return self.router.acquire(timeout=10)

    def release(self, idx, served):
        self.router.release(idx, served)

    def client(self, idx):
        fleet = self

        class Flaky:
            def generate(self, ids, params, return_logprob, timeout=None):
                with fleet.lock:
                    fleet.sent.append(params["sampling_seed"])
                    if idx == 1 and fleet.fail > 0:
                        fleet.fail -= 1
                        raise EngineUnreachable("http://x", "/generate", ConnectionRefusedError("refused"))
                return fleet.clients[idx].generate(ids, params, return_logprob, timeout=timeout)

            host, port = fleet.clients[idx].host, fleet.clients[idx].port

        return Flaky()

    def generation(self, idx):
        return self.gen[idx]

    def report_failure(self, idx, generation, error):
        with self.lock:
            if self.gen[idx] != generation:
                return
            self.failures.append(idx)
            if len(self.failures) > self.restarts_allowed:
                raise RolloutError(f"engine {idx} restarts used up")
            self.gen[idx] += 1

    def wait_unpaused(self):
        pass

    def note_version(self, idx, version):
        pass


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.utils.http_client import EngineClient
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("ck") / "m"), "glm4_moe_lite")
    engine = EmbeddedEngine(EngineConfig(model_path=path))
    servers = [EngineHTTPServer(engine, "t", 0), EngineHTTPServer(engine, "t", 0)]  # one model, two endpoints
    for s in servers:
        s.start_in_thread()
    yield path, [EngineClient(s.url, "t") for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()
    engine.shutdown()


def _rollout_args(tmp_path, **kw):
    from slime.rollout.synthetic import main

    data = tmp_path / "data.jsonl"
    main(["--out", str(data), "--num", "12"])
    return rollout_defaults(prompt_data=str(data), apply_chat_template=True, rollout_batch_size=5,
                            n_samples_per_prompt=3, rollout_max_response_len=6, rm_type="synthetic", max_concurrency=4, **kw)


def _rollout_setup(tmp_path, tokenizer):
    """(args, data source) of a 5 prompts x 3 samples synthetic rollout."""
    args = _rollout_args(tmp_path)
    return args, JsonlDataSource(args.prompt_data, tokenizer, apply_chat_template=True)


def test_generate_rollout_every_sample_once_despite_failures(engines, tmp_path, tokenizer):
    path, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    fleet = _Fleet(clients, fail=3)
    samples, metrics = generate_rollout(args, fleet, ds, tokenizer, get_reward_fn(args))
    assert [s.index for s in samples] == list(range(15))
    assert [s.group_index for s in samples] == [g for g in range(5) for _ in range(3)]
    assert len(fleet.failures) >= 1 and metrics["rollout/reissued_requests"] == 3
    assert len(fleet.sent) == 15 + 3  # each lost request re-sent once, nothing else
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.reward is not None
        assert s.tokens[: s.prompt_length] == ds.items[s.group_index][1]
        assert s.response_length == len(s.tokens) - s.prompt_length == len(s.loss_mask) == len(s.rollout_log_probs)
        assert 1 <= s.response_length <= 6 and s.reward == pytest.approx(score(s.response, s.label))
    # The next rollout continues the data and the sample numbering.
    more, _ = generate_rollout(args, _Fleet(clients), ds, tokenizer, get_reward_fn(args))
    assert [s.index for s in more] == list(range(15, 30)) and more[0].group_index == 5


def test_generate_rollout_group_rm_scores_each_prompt_once_its_samples_are_generated(engines, tmp_path, tokenizer):
    """--group-rm on the built-in path: the reward sees one prompt's samples together, each already generated,
    once per prompt (the generation loop finishes a group with its reward), and the per-sample reward is not
    called."""
    _, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.group_rm = True
    seen = []

    def group_reward(a, samples):
        assert all(s.response_length >= 1 and s.status != SampleStatus.PENDING for s in samples)
        seen.append([s.index for s in samples])
        return [float(s.index) + 0.5 for s in samples]

    samples, _ = generate_rollout(args, _Fleet(clients, fail=2), ds, tokenizer, group_reward)
    assert sorted(seen) == [[3 * g, 3 * g + 1, 3 * g + 2] for g in range(5)]  # a prompt's group, once
    assert [s.reward for s in samples] == [i + 0.5 for i in range(15)]


def test_generate_rollout_gives_up_loudly(engines, tmp_path, tokenizer):
    _, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    with pytest.raises(RolloutError, match="restarts used up"):
        generate_rollout(args, _Fleet(clients, fail=100, restarts_allowed=2), ds, tokenizer, get_reward_fn(args))
    bad = _rollout_args(tmp_path, rollout_top_p=0.0)
    with pytest.raises(RolloutError, match="rejected sample .*top_p"):
        generate_rollout(bad, _Fleet(clients), ds, tokenizer, None)


def test_engine_side_errors_are_reported_not_retried(engines, tmp_path, tokenizer):
    _, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    fleet = _Fleet(clients)
    calls = []

    class Broken:
        def generate(self, ids, params, return_logprob, timeout=None):
            calls.append(1)
            return {"output_ids": [], "meta_info": {"finish_reason": {
                "type": "abort", "message": "engine error: RuntimeError: out of memory"}}}

    fleet.client = lambda idx: Broken()
    with pytest.raises(RolloutError, match="out of memory"):
        generate_rollout(args, fleet, ds, tokenizer, None)
    assert len(calls) <= args.max_concurrency  # no retry loop


@pytest.mark.parametrize("overrides, needle", [
    ({"prompt_data": "x.jsonl", "rm_type": "math"}, "--rollout-batch-size is required"),
    ({"prompt_data": "x.jsonl", "rollout_batch_size": 4}, "no reward"),
    ({"rollout_top_p": 0.0}, "--rollout-top-p"),
    ({"rollout_top_k": 0}, "--rollout-top-k"),
    ({"n_samples_per_prompt": 0}, "--n-samples-per-prompt"),
    ({"rollout_max_response_len": 0}, "--rollout-max-response-len"),
])
def test_rollout_flag_validation(overrides, needle):
    from slime.config.rollout_args import RolloutArgumentError, validate_rollout_args

    with pytest.raises(RolloutArgumentError, match=needle):
        validate_rollout_args(rollout_defaults(**overrides))
    assert validate_rollout_args(rollout_defaults(prompt_data="x", rollout_batch_size=2, rm_type="math"))


def test_engine_times_are_differences_of_engine_stats_over_the_rollout():
    """Per rollout: each used engine's /health stats before its first request and after the rollout; the
    busiest engine's wave time is the rollout's engine generate time. Engines without stats (SGLang) and
    engines restarted in between (counters start again) are left out."""
    from slime.rollout.generate import EngineTimes

    class Client:
        def __init__(self, seq):
            self.seq = list(seq)

        def get(self, path, timeout=None):
            assert path == "/health"
            stats = self.seq.pop(0)
            return {"status": "ok", **({"stats": stats} if stats is not None else {})}

    def st(wave, fwd, waves):
        return {"wave_seconds": wave, "forward_seconds": fwd, "waves": waves, "joins": 0, "generated_tokens": 5}

    clients = {0: Client([st(1.0, 0.5, 3), st(1.4, 0.8, 5)]), 1: Client([st(2.0, 1.0, 1), st(2.25, 1.1, 2)]),
               2: Client([None, None]), 3: Client([st(9.0, 4.0, 9), st(0.5, 0.2, 1)])}

    class Fleet:
        def client(self, idx):
            return clients[idx]

    times = EngineTimes(Fleet())
    for idx in (0, 1, 0, 2, 3, 1):
        times.first_use(idx)  # one snapshot per engine, however many requests
    m = times.metrics()
    assert m["rollout/engine_generate_time"] == pytest.approx(0.4)  # engine 0: 1.4 - 1.0 (> 0.25 of engine 1)
    assert m["rollout/engine_forward_time"] == pytest.approx(0.3)
    assert m["rollout/engine_waves"] == 3.0  # 2 + 1; engine 3 (restarted) and 2 (no stats) left out
    assert EngineTimes(Fleet()).metrics() == {}
    # the rollout manager's /health replies of just before the rollout start the snapshot: one /health less
    clients[0] = Client([st(1.4, 0.8, 5)])  # only the reply after the rollout is left to read
    given = EngineTimes(Fleet(), health={0: {"status": "ok", "stats": st(1.0, 0.5, 3)}})
    given.first_use(0)
    assert given.metrics()["rollout/engine_generate_time"] == pytest.approx(0.4) and clients[0].seq == []


def test_batched_requests_give_every_sample_once_despite_failures_and_aborts(engines, tmp_path, tokenizer):
    """A fleet that says how many engines it has gets one batched /generate per engine share; a lost
    request puts all its samples back, an aborted sample alone goes back; the samples equal those of the
    one-request-per-sample path (same seeds)."""
    from slime.rollout.generate import samples_per_request

    _, clients = engines

    class BatchFleet(_Fleet):
        def __init__(self, *a, abort_once=(), **kw):
            super().__init__(*a, **kw)
            self.requests, self.abort_once = [], set(abort_once)

        def num_engines(self):
            return len(self.clients)

        def client(self, idx):
            fleet = self

            class Flaky:
                def generate(self, ids, params, return_logprob, timeout=None):
                    seeds = [p["sampling_seed"] for p in (params if isinstance(params, list) else [params])]
                    with fleet.lock:
                        fleet.requests.append(len(seeds))
                        if idx == 1 and fleet.fail > 0:
                            fleet.fail -= 1
                            raise EngineUnreachable("http://x", "/generate", ConnectionRefusedError("refused"))
                    out = fleet.clients[idx].generate(ids, params, return_logprob, timeout=timeout)
                    for o, seed in zip(out if isinstance(out, list) else [out], seeds):
                        if seed in fleet.abort_once:
                            fleet.abort_once.discard(seed)
                            o["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
                    return out

            return Flaky()

    from slime.rollout.generate import sample_seed

    args, ds = _rollout_setup(tmp_path, tokenizer)
    reference, _ = generate_rollout(args, _Fleet(clients), ds, tokenizer, get_reward_fn(args))  # per sample
    args, ds = _rollout_setup(tmp_path, tokenizer)  # the same prompts and sample indices again
    args.max_concurrency = 64
    fleet = BatchFleet(clients, fail=1, abort_once={sample_seed(args, 0)})
    assert samples_per_request(args, fleet, 15) == 8 and samples_per_request(args, _Fleet(clients), 15) == 1
    samples, metrics = generate_rollout(args, fleet, ds, tokenizer, get_reward_fn(args))
    assert [s.index for s in samples] == list(range(15))
    assert metrics["rollout/aborted_requests"] == 1 and metrics["rollout/reissued_requests"] >= 1
    assert max(fleet.requests) > 1 and len(fleet.requests) < 15
    for a, b in zip(reference, samples):
        assert a.tokens == b.tokens and a.reward == b.reward


def test_behind_a_router_batches_carry_one_sampling_params_and_consecutive_seeds(engines, tmp_path, tokenizer):
    """Through sglang-router (one sampling_params object per request) a request carries a run of samples with
    consecutive seeds and the first one's params; the engine seeds item i with seed + i, so the samples are
    the per-sample path's (same tokens and rewards; log-probs within float rounding), aborted ones included."""
    from slime.rollout.generate import sample_seed, samples_per_request

    _, clients = engines

    class RouterFleet(_Fleet):
        def __init__(self, *a, abort_once=(), **kw):
            super().__init__(*a, **kw)
            self.requests, self.abort_once = [], set(abort_once)

        def num_engines(self):
            return len(self.clients)

        def behind_router(self):
            return True

        def generation_client(self, idx):
            fleet = self

            class Router:
                def generate(self, ids, params, return_logprob, timeout=None):
                    batch = isinstance(ids[0], list)
                    assert isinstance(params, dict)  # what sglang-router forwards
                    with fleet.lock:
                        fleet.requests.append((len(ids) if batch else 1, params["sampling_seed"]))
                    out = fleet.clients[idx].generate(ids, params, return_logprob, timeout=timeout)
                    for i, o in enumerate(out if batch else [out]):
                        if params["sampling_seed"] + i in fleet.abort_once:
                            fleet.abort_once.discard(params["sampling_seed"] + i)
                            o["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
                    return out

            return Router()

    args, ds = _rollout_setup(tmp_path, tokenizer)
    reference, _ = generate_rollout(args, _Fleet(clients), ds, tokenizer, get_reward_fn(args))  # per sample
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.max_concurrency = 64
    fleet = RouterFleet(clients, abort_once={sample_seed(args, 4)})
    assert samples_per_request(args, fleet, 15) == 8
    samples, metrics = generate_rollout(args, fleet, ds, tokenizer, get_reward_fn(args))
    assert [s.index for s in samples] == list(range(15)) and metrics["rollout/aborted_requests"] == 1
    assert max(n for n, _ in fleet.requests) > 1 and len(fleet.requests) < 15
    assert sorted(seed for _, seed in fleet.requests)[0] == sample_seed(args, 0)
    for a, b in zip(reference, samples):
        assert a.tokens == b.tokens and a.reward == b.reward  # (log-probs: float rounding of another batch shape)
        assert b.rollout_log_probs == pytest.approx(a.rollout_log_probs, abs=1e-5)


def test_dynamic_sampling_keeps_the_first_groups_that_pass_the_filter(engines, tmp_path, tokenizer):
    """A built-in run with --dynamic-sampling-filter-path / --over-sampling-batch-size runs upstream's loop
    (the rollout manager's choice): on the embedded engine, groups submitted --over-sampling-batch-size at a time
    until --rollout-batch-size groups that the filter keeps have finished; the upstream-named filter drops
    groups whose rewards are all equal."""
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
    from slime.rollout.plugin_rollout import make_data_source, plugin_args, run_plugin_rollout, uses_plugin_rollout
    from slime.rollout.sglang_rollout import GenerateState

    path, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.hf_checkpoint = path
    args.dynamic_sampling_filter_path = "tests.test_rollout:_odd_groups_only"
    args.rollout_batch_size, args.over_sampling_batch_size = 2, 3
    assert uses_plugin_rollout(args)
    args = plugin_args(args, clients[0].url, 1, clients[:1])
    GenerateState.clear_instances()
    try:
        samples, _ = run_plugin_rollout(args, 0, make_data_source(args, ds, tokenizer))
    finally:
        GenerateState.clear_instances()
    groups = sorted({s.group_index for s in samples})
    assert len(samples) == 6 and len(groups) == 2 and all(g % 2 == 1 for g in groups)
    assert [s.index for s in samples] == sorted(s.index for s in samples)
    assert all(s.reward == pytest.approx(score(s.response, s.label)) for s in samples)
    tie = [Sample(group_index=0, index=i, prompt="p", reward=0.5) for i in range(3)]
    assert not check_reward_nonzero_std(args, tie)
    tie[1].reward = 0.0
    assert check_reward_nonzero_std(args, tie)


def _odd_groups_only(args, samples):
    return samples[0].group_index % 2 == 1


def test_custom_generate_function_replaces_the_generate_call(engines, tmp_path, tokenizer):
    """--custom-generate-function-path (upstream's fn(args, sample, sampling_params)): called per sample with
    the chosen engine's client; its loss mask reaches the sample, the reward is still ours."""
    _, clients = engines
    args, ds = _rollout_setup(tmp_path, tokenizer)
    args.custom_generate_function_path = "tests.test_rollout:_generate_and_mask_tail"
    samples, _ = generate_rollout(args, _Fleet(clients), ds, tokenizer, get_reward_fn(args))
    assert len(samples) == 15 and all(s.metadata["custom"] for s in samples)
    for s in samples:
        n = s.response_length
        assert s.loss_mask == [1] * (n - n // 2) + [0] * (n // 2) and s.reward is not None
        assert len(s.tokens) == s.prompt_length + n and len(s.rollout_log_probs) == n


def _generate_and_mask_tail(args, sample, sampling_params):
    out = args.engine_client.generate(sample.prompt_tokens, sampling_params, return_logprob=True)
    assert (args.sglang_router_ip, args.sglang_router_port) == (args.engine_client.host, args.engine_client.port)
    ids = list(out["output_ids"])
    sample.tokens = sample.prompt_tokens + ids
    sample.response_length = len(ids)
    sample.rollout_log_probs = [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]
    sample.loss_mask = [1] * (len(ids) - len(ids) // 2) + [0] * (len(ids) // 2)  # e.g. a tool's output
    sample.response = out.get("text", "")
    sample.metadata["custom"] = True
    return sample
