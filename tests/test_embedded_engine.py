"""Embedded engine over HTTP: exactness vs transformers, sampling, errors, auth, weight updates."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
from slime.utils.http_client import EngineClient, EngineError

TOKEN = "test-token-5f2c"
MAX_NEW = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    base = tmp_path_factory.mktemp("ckpt")
    return {
        "lite0": write_tiny_checkpoint(str(base / "lite0"), "glm4_moe_lite", seed=0),
        "lite1": write_tiny_checkpoint(str(base / "lite1"), "glm4_moe_lite", seed=1),
        # The tiny index_topk (8) is below most sequence lengths here: DSA drops keys, and the engine's
        # cached decode must keep the keys a full forward keeps (ties included: transformers patch set).
        "dsa": write_tiny_checkpoint(str(base / "dsa"), "glm_moe_dsa", seed=2),
    }


def _serve(path: str, **cfg):
    engine = EmbeddedEngine(EngineConfig(model_path=path, **cfg))
    server = EngineHTTPServer(engine, TOKEN, 0)
    server.start_in_thread()
    return server, EngineClient(server.url, TOKEN)


@pytest.fixture(scope="module")
def served(ckpts):
    server, client = _serve(ckpts["lite0"])
    yield server, client
    server.stop()


@pytest.fixture
def restore(served, ckpts):
    """Tests that change weights put the seed-0 checkpoint back afterwards."""
    yield
    served[1].update_weights_from_disk(ckpts["lite0"], weight_version="default")


def _hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # grouped_mm (the default experts kernel) has no float64 path; the loop over experts does.
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).eval()


def _prompts(seed: int, lengths=(1, 4, 7, 13, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 512, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _params(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _assert_params_equal(engine: EmbeddedEngine, expected: dict[str, torch.Tensor]) -> None:
    for n, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), expected[n]), n


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("kind", ["lite0", "dsa"])
def test_greedy_batch_equals_transformers_generate(ckpts, served, kind):
    server, client = served if kind == "lite0" else _serve(ckpts[kind])
    try:
        prompts = _prompts(1)
        outs = client.generate(prompts, {"max_new_tokens": MAX_NEW, "temperature": 0}, return_logprob=True)
        assert server.engine.stats["waves"] >= 1
        model = _hf(ckpts[kind])
        for p, o in zip(prompts, outs):
            ref = _hf_greedy(model, p, MAX_NEW)
            assert o["output_ids"] == ref, (p, o["output_ids"], ref)
            lp = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
            assert [x[1] for x in o["meta_info"]["output_token_logprobs"]] == ref
            torch.testing.assert_close(lp, _teacher_forced_logprobs(model, p, ref), atol=1e-4, rtol=0)
    finally:
        if kind != "lite0":
            server.stop()


def test_requests_joining_a_running_wave_stay_exact(ckpts, served):
    """Late requests join the running wave (re-prefill): tokens and logprobs are unchanged by it."""
    server, client = served
    prompts = _prompts(11, lengths=(3, 8, 5, 11))
    joins = server.engine.stats["joins"]
    box = {}
    first = threading.Thread(target=lambda: box.update(
        first=client.generate(prompts[0], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}, True)))
    first.start()
    _wait_for_running(client)
    late = client.generate(prompts[1:], {"max_new_tokens": 12, "temperature": 0}, return_logprob=True)
    first.join(timeout=60)
    assert server.engine.stats["joins"] > joins
    model = _hf(ckpts["lite0"])
    for p, o in zip(prompts, [box["first"]] + late):
        n = o["meta_info"]["completion_tokens"]
        ref = _greedy_without_cache(model, p, n) if n == 40 else _hf_greedy(model, p, 12)
        assert o["output_ids"] == ref
        lp = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(lp, _teacher_forced_logprobs(model, p, ref), atol=1e-4, rtol=0)


def _greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):  # EOS ignored, as the request asked
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _wait_for_running(client) -> None:
    deadline = time.monotonic() + 30
    while client.get("/health")["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.002)


def test_sampled_logprobs_equal_teacher_forced_pass(ckpts, served):
    _, client = served
    model32, model64 = _hf(ckpts["lite0"]), _hf(ckpts["lite0"], torch.float64)
    prompts = _prompts(2, lengths=(3, 9, 5))
    for temperature in (1.0, 0.7):
        outs = client.generate(prompts, [{"max_new_tokens": 12, "temperature": temperature, "sampling_seed": 10 + i,
                                          "ignore_eos": True} for i in range(len(prompts))], return_logprob=True)
        for p, o in zip(prompts, outs):
            resp = o["output_ids"]
            assert len(resp) == 12 and o["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
            got = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
            # float32 teacher-forced pass: same arithmetic up to reduction order.
            torch.testing.assert_close(got, _teacher_forced_logprobs(model32, p, resp, temperature), atol=2e-5, rtol=0)
            # float64 reference: the model's float32 rounding only.
            torch.testing.assert_close(got, _teacher_forced_logprobs(model64, p, resp, temperature), atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_across_batches(served):
    _, client = served
    params = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "sampling_seed": 1234,
              "ignore_eos": True}
    prompt = _prompts(3, lengths=(6,))[0]
    alone = client.generate(prompt, params, return_logprob=True)
    crowd = client.generate([_prompts(4)[0], prompt, _prompts(5)[1]], [dict(params, sampling_seed=7), params, params],
                            return_logprob=True)
    again = client.generate(prompt, dict(params, seed=1234, sampling_seed=None), return_logprob=True)
    assert alone["output_ids"] == crowd[1]["output_ids"] == again["output_ids"]
    assert alone["meta_info"]["output_token_logprobs"] == again["meta_info"]["output_token_logprobs"]
    other = client.generate(prompt, dict(params, sampling_seed=99))
    assert other["output_ids"] != alone["output_ids"]


def test_truncation_and_stop_rules(served):
    _, client = served
    prompt = _prompts(6, lengths=(5,))[0]
    greedy = client.generate(prompt, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    # top_k=1 and a tiny nucleus leave only the argmax token, whatever the seed.
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        out = client.generate(prompt, {"max_new_tokens": 8, "temperature": 1.3, "sampling_seed": 5, **extra})
        assert out["output_ids"] == greedy
    stop_tok = greedy[3]
    out = client.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_tok]})
    first = greedy.index(stop_tok)
    assert out["output_ids"] == greedy[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    out = client.generate(prompt, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------ errors and auth
@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [5, 6], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ({"input_ids": [5, 6], "sampling_params": {"temprature": 1}}, "unsupported sampling_params"),
    ({"input_ids": [5, 6], "sampling_params": {"stop_token_ids": [9999]}}, "stop_token_ids"),
    ({"input_ids": [5, 600]}, "outside the vocabulary"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [[5, 6], []]}, "non-empty"),
    ({"input_ids": [5, "a"]}, "integers"),
    ({"input_ids": [7] * 512}, "context length is 512"),
    ({"sampling_params": {}}, "input_ids"),
])
def test_bad_generate_requests_get_400_and_engine_keeps_serving(served, body, needle):
    _, client = served
    with pytest.raises(EngineError) as e:
        client.post("/generate", body)
    assert e.value.status == 400 and needle in e.value.message and "\n" not in e.value.message
    assert client.generate([5, 6], {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_malformed_json_and_unknown_endpoint(served):
    import http.client

    server, client = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/generate", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and b"not valid JSON" in resp.read()
    conn.close()
    with pytest.raises(EngineError) as e:
        client.post("/no_such_endpoint", {})
    assert e.value.status == 404
    assert client.health()


def test_control_endpoints_require_the_token(served):
    server, client = served
    anonymous, wrong = EngineClient(server.url), EngineClient(server.url, "nope")
    for c in (anonymous, wrong):
        for call in (lambda c=c: c.pause_generation(), lambda c=c: c.release_memory_occupation(),
                     lambda c=c: c.update_weights_from_disk("/x"), lambda c=c: c.destroy_weights_update_group("g")):
            with pytest.raises(EngineError) as e:
                call()
            assert e.value.status == 401 and "Authorization: Bearer" in e.value.message
        assert c.generate([5, 6], {"max_new_tokens": 1})["output_ids"]  # generation stays open


def test_arbitrary_pickle_is_refused(served, tmp_path):
    server, client = served
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    before = _params(server.engine)
    for payload in (pickle.dumps([("model.norm.weight", Evil())]), pickle.dumps(Evil()), b"\x80\x04garbage"):
        with pytest.raises(EngineError) as e:
            client.post("/update_weights_from_tensor",
                        {"serialized_named_tensors": [base64.b64encode(payload).decode()]})
        assert e.value.status == 400
    assert not marker.exists()
    _assert_params_equal(server.engine, before)


# ------------------------------------------------------------------ weight updates
def _run_trainer_process(script: str, *argv: str, tmp_path) -> tuple[str, str]:
    """Run a producer in its own process. Output goes to files, not pipes: with the file_system
    sharing strategy torch's shm manager daemon inherits the producer's stdio and outlives it."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=fo, stderr=fe, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
        rc = proc.wait(timeout=120)
    assert rc == 0, err.read_text()[-2000:]
    return out.read_text(), err.read_text()


def _checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(os.path.join(path, "model.safetensors")).items())


def test_ipc_update_from_another_process_equals_loading_the_checkpoint(ckpts, served, restore, tmp_path):
    server, client = served
    script = textwrap.dedent("""
        import sys
        from safetensors.torch import load_file
        from slime.utils.http_client import EngineClient
        url, token, path, fmt = sys.argv[1:5]
        named = sorted(load_file(path + "/model.safetensors").items())
        reply = EngineClient(url, token).update_weights_from_tensor(
            named, load_format=None if fmt == "none" else fmt, weight_version="v1")
        print(reply["message"])
    """)
    stdout, _ = _run_trainer_process(script, server.url, TOKEN, ckpts["lite1"], "none", tmp_path=tmp_path)
    assert "updated 91 weights" in stdout
    expected = _hf(ckpts["lite1"])
    ref = {n: p.detach() for n, p in expected.named_parameters()}
    _assert_params_equal(server.engine, ref)  # per-expert HF names landed in the fused expert tensors
    prompt = _prompts(7, lengths=(6,))[0]
    out = client.generate(prompt, {"max_new_tokens": MAX_NEW, "temperature": 0}, return_logprob=True)
    assert out["output_ids"] == _hf_greedy(expected, prompt, MAX_NEW)
    assert out["meta_info"]["weight_version"] == "v1"


def test_flattened_bucket_update(ckpts, served, restore):
    server, client = served
    named = _checkpoint_tensors(ckpts["lite1"])
    named[0] = (named[0][0], named[0][1].to(torch.float64))  # a second dtype -> a second bucket
    with pytest.raises(EngineError) as e:
        client.update_weights_from_tensor(named, load_format="flattened_bucket")
    assert "dtype float64 != model float32" in e.value.message
    named[0] = (named[0][0], named[0][1].to(torch.float32))
    reply = client.update_weights_from_tensor(named, load_format="flattened_bucket", weight_version="b1")
    assert reply["weight_version"] == "b1"
    _assert_params_equal(server.engine, {n: p.detach() for n, p in _hf(ckpts["lite1"]).named_parameters()})


def test_bad_updates_change_nothing(ckpts, served, restore):
    server, client = served
    good = _checkpoint_tensors(ckpts["lite1"])
    before = _params(server.engine)
    expert = next(n for n, _ in good if ".experts.3.up_proj" in n)
    cases = [
        (good + [("model.layers.9.mlp.gate.weight", torch.zeros(8, 64))], "unknown weight"),
        ([(n, t.T.contiguous() if n == expert else t) for n, t in good], "shape"),
        ([(n, t.double() if n == expert else t) for n, t in good], "dtype"),
        (good + [good[0]], "appears twice"),
    ]
    for named, needle in cases:
        with pytest.raises(EngineError) as e:
            client.update_weights_from_tensor(named)
        assert e.value.status == 400 and needle in e.value.message and "nothing changed" in e.value.message
        _assert_params_equal(server.engine, before)
    with pytest.raises(EngineError) as e:
        client.update_weights_from_disk(ckpts["lite0"] + "/missing")
    assert e.value.status == 400
    assert server.engine.weight_version == "default"
    _assert_params_equal(server.engine, before)


def test_update_from_disk_release_and_resume(ckpts, served, restore):
    server, client = served
    prompt = _prompts(8, lengths=(4,))[0]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0}
    base = client.generate(prompt, params)["output_ids"]
    client.update_weights_from_disk(ckpts["lite1"], weight_version="disk1")
    assert client.generate(prompt, params)["output_ids"] == _hf_greedy(_hf(ckpts["lite1"]), prompt, MAX_NEW)
    client.release_memory_occupation(["weights"])
    assert all(p.numel() == 0 for p in server.engine.model.parameters())
    with pytest.raises(EngineError) as e:
        client.update_weights_from_disk(ckpts["lite0"])
    assert "released" in e.value.message
    client.resume_memory_occupation(["weights"])
    assert all(torch.isnan(p).all() for p in server.engine.model.parameters())  # poisoned until updated
    client.update_weights_from_disk(ckpts["lite0"])
    assert client.generate(prompt, params)["output_ids"] == base


def _wait_for_queued(client, n: int = 1) -> None:
    """Until `n` requests wait in the paused engine's queue. Not the running count: the previous wave can stay
    counted as running for a moment after its client has its answer, and the new request may not be there yet."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if client.get("/health")["num_queued_reqs"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError("request never reached the engine")


def test_pause_in_place_and_abort(served):
    _, client = served
    client.pause_generation(mode="in_place")
    held = {}
    t = threading.Thread(target=lambda: held.update(out=client.generate([5, 6, 7], {"max_new_tokens": 3})))
    t.start()
    _wait_for_queued(client)
    time.sleep(0.2)
    assert "out" not in held  # queued while paused
    client.continue_generation()
    t.join(timeout=30)
    assert held["out"]["meta_info"]["finish_reason"]["type"] == "length"
    client.pause_generation(mode="in_place")
    aborted = {}
    t = threading.Thread(target=lambda: aborted.update(out=client.generate([5, 6, 7], {"max_new_tokens": 3})))
    t.start()
    _wait_for_queued(client)
    client.pause_generation(mode="abort")  # queued/running requests return now, marked abort
    t.join(timeout=30)
    assert aborted["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    client.continue_generation()
    assert client.generate([5, 6, 7], {"max_new_tokens": 3})["meta_info"]["finish_reason"]["type"] == "length"


def test_distributed_update_two_processes_over_gloo(ckpts, served, restore, tmp_path):
    """The trainer side (rank 0) runs in a second process; a rejected update must not hang it."""
    server, client = served
    script = textwrap.dedent("""
        import socket, sys, threading
        from safetensors.torch import load_file
        from slime.utils.distributed import init_custom_process_group, broadcast, destroy_custom_process_group
        from slime.utils.http_client import EngineClient, EngineError
        url, token, path = sys.argv[1:4]
        c = EngineClient(url, token)
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        t = threading.Thread(target=c.init_weights_update_group, args=("127.0.0.1", port, 1, 2, "g"))
        t.start()
        pg = init_custom_process_group("127.0.0.1", port, 2, 0, "g")
        t.join()

        def send(named):
            box = {}
            def post():
                try:
                    box["reply"] = c.update_weights_from_distributed(
                        [n for n, _ in named], [str(x.dtype).split(".")[1] for _, x in named],
                        [list(x.shape) for _, x in named], "g", weight_version="d1")
                except EngineError as e:
                    box["error"] = e.message
            th = threading.Thread(target=post); th.start()
            for _, x in named:
                broadcast(x.contiguous(), 0, pg)
            th.join()
            return box

        named = sorted(load_file(path + "/model.safetensors").items())
        bad = send([(n, x[:1] if i == 3 else x) for i, (n, x) in enumerate(named)])
        print("BAD", bad.get("error"))
        good = send(named)
        print("GOOD", good.get("reply", good.get("error")))
        c.destroy_weights_update_group("g")
        destroy_custom_process_group(pg)
    """)
    before = _params(server.engine)
    stdout, _ = _run_trainer_process(script, server.url, TOKEN, ckpts["lite1"], tmp_path=tmp_path)
    assert "BAD weight update rejected, nothing changed" in stdout and "shape" in stdout
    assert "GOOD {'success': True" in stdout, stdout
    assert not torch.equal(before["model.embed_tokens.weight"], server.engine.model.model.embed_tokens.weight)
    _assert_params_equal(server.engine, {n: p.detach() for n, p in _hf(ckpts["lite1"]).named_parameters()})
    assert server.engine.weight_version == "d1" and not server.engine._groups


def test_weight_sync_distributed_flattened_buckets_are_bit_exact_reuse_one_buffer_and_refuse_whole(ckpts, served,
                                                                                                      restore, tmp_path):
    """WeightSync's distributed path (trainer rank 0 in a second process) against the engine: one flattened
    broadcast per bucket (the engine advertises it), transposed views packed like contiguous ones, every
    weight bit-exact after the sync and checked by checksums, the engine's receive buffer the same one on
    the next sync; an update the engine refuses (a wrong shape) changes nothing and hangs nothing."""
    server, _ = served
    assert server.engine.model_info()["distributed_flattened_bucket"] is True
    script = textwrap.dedent("""
        import sys
        from safetensors.torch import load_file
        from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync, WeightSyncError
        url, token, path = sys.argv[1:4]
        named = sorted(load_file(path + "/model.safetensors").items())
        # every other 2-D weight as a column-major view (as the GLM export hands out expert weights)
        named = [(n, t.t().contiguous().t() if t.dim() == 2 and i % 2 else t) for i, (n, t) in enumerate(named)]
        buckets = [named[i:i + 7] for i in range(0, len(named), 7)]
        ws = WeightSync("distributed", lambda: iter(buckets), [EngineEndpoint(url, token=token)], rank=0, timeout_s=60)
        print("CHECKED", int(ws.sync(version=5)["weight_sync/checked_tensors"]), len(named), flush=True)
        input()  # the test looks at the engine's receive buffer
        ws.export = lambda: iter(buckets[::-1])
        ws.sync(version=6)
        print("SYNCED 6", flush=True)
        input()
        n, t = buckets[0][3]
        ws.export = lambda: iter([buckets[0][:3] + [(n, t[:1])] + buckets[0][4:]])
        try:
            ws.sync(version=7)
        except WeightSyncError as e:
            print("REFUSED", str(e).splitlines()[0], flush=True)
        ws.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, server.url, TOKEN, ckpts["lite1"]], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"))
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["CHECKED"] and line[1] == line[2], (line, (tmp_path / "stderr").read_text()[-2000:])
        _assert_params_equal(server.engine, {n: p.detach() for n, p in _hf(ckpts["lite1"]).named_parameters()})
        # numbered updates: two receive buffers per group (one receiving while the other is copied out)
        buffers = {b.data_ptr() for b in server.engine._packed_buffers.values()}
        assert 1 <= len(buffers) <= 2
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "SYNCED 6"
        after = {b.data_ptr() for b in server.engine._packed_buffers.values()}
        assert len(after) <= 2 and after & buffers  # kept (the one that held the largest bucket never grows)
        before = _params(server.engine)
        proc.stdin.write("\n")
        proc.stdin.flush()
        refused = proc.stdout.readline()
        assert refused.startswith("REFUSED") and "shape" in refused and "nothing changed" in refused, refused
        assert proc.wait(timeout=120) == 0, (tmp_path / "stderr").read_text()[-2000:]
        _assert_params_equal(server.engine, before)
        assert server.engine.weight_version == "6"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_flattened_receive_views_every_tensor_of_a_gapless_mixed_dtype_layout():
    """SGLang's gapless packing can leave a tensor unaligned for its dtype (float32 after 3 bfloat16 values):
    such a tensor is copied out of the receive buffer, the aligned ones are views; values bit-exact."""
    from types import SimpleNamespace

    from slime.backends.embedded.engine_weights import WeightControl

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, generator=g).bfloat16(), torch.randn(2, 5, generator=g), torch.randn(7, generator=g).half(),
               torch.randint(0, 100, (4,), generator=g)]
    host = SimpleNamespace(device=torch.device("cpu"))
    specs = [(f"t{i}", list(t.shape), t.dtype) for i, t in enumerate(tensors)]
    recv, sources = WeightControl._packed_receive(host, "g", specs)
    assert recv.numel() == sum(t.numel() * t.element_size() for t in tensors)
    recv.copy_(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]))  # what the broadcast delivers
    got = [f() for f in sources]
    for t, x in zip(tensors, got):
        assert x.dtype == t.dtype and torch.equal(x, t)
    assert got[0].data_ptr() == recv.data_ptr()  # aligned: a view
    assert got[1].untyped_storage().data_ptr() != recv.untyped_storage().data_ptr()  # offset 6: copied
    again, _ = WeightControl._packed_receive(host, "g", specs[:2])
    assert again.data_ptr() == recv.data_ptr()  # the same buffer, kept for the group


def test_weights_checksum_and_model_info(ckpts, served):
    from slime.utils.weight_checksum import mismatches, named_checksums

    _, client = served
    named = _checkpoint_tensors(ckpts["lite0"])
    reply = client.post("/get_weights_checksum", {"names": [n for n, _ in named]})
    assert mismatches(named_checksums(named), reply["checksums"]) == []
    other = dict(_checkpoint_tensors(ckpts["lite1"]))
    expert = next(n for n in other if ".experts.5.gate_proj" in n)
    assert mismatches(named_checksums([(expert, other[expert])]), {expert: reply["checksums"][expert]}) == [expert]
    info = client.get_model_info()
    assert info["dtype"] == "float32" and info["max_context_length"] == 512 and info["vocab_size"] == 512


def test_ipc_update_through_each_accelerator(accel, ckpts):
    """Handles made by the accelerator's own reduce_tensor, opened with its own allow-list (cpu, simulated
    Ascend, and real devices when present)."""
    from slime.accelerator.ipc import serialize_named_tensors

    server, client = _serve(ckpts["lite0"])
    try:
        assert server.engine.device == accel.device()
        named = [(n, t.to(accel.device())) for n, t in _checkpoint_tensors(ckpts["lite1"])]
        payload = base64.b64encode(serialize_named_tensors(accel, named)).decode()
        client.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "x"})
        ref = {n: p.detach().to(accel.device()) for n, p in _hf(ckpts["lite1"]).named_parameters()}
        _assert_params_equal(server.engine, ref)
    finally:
        server.stop()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_any_hf_causal_lm(arch, tmp_path):
    """Not only GLM: a Llama (untied) and a GPT-2 (tied embeddings, learned positions) checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    cfg = (LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
           if arch == "llama" else GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                              bos_token_id=1, eos_token_id=2))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    engine = EmbeddedEngine(EngineConfig(model_path=str(tmp_path)))
    try:
        prompts = _prompts(9, lengths=(2, 9, 5))
        prompts = [[t % 300 for t in p] for p in prompts]
        reqs = [engine.submit(engine.make_request(p, {"max_new_tokens": 8, "temperature": 0}, True)) for p in prompts]
        ref_model = _hf(str(tmp_path))
        for p, r in zip(prompts, reqs):
            r.done.wait()
            assert r.output_ids == _hf_greedy(ref_model, p, 8)
            torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64),
                                       _teacher_forced_logprobs(ref_model, p, r.output_ids), atol=1e-4, rtol=0)
        names = set(load_file(str(tmp_path / "model.safetensors")))
        assert names == set(engine.name_map.checkpoint_names())  # tied lm_head is not expected from a checkpoint
    finally:
        engine.shutdown()


def test_weight_sync_group_leaves_the_default_group_alone(tmp_path):
    """Rank 0 already has a default world (as a Megatron trainer does); the custom group must not touch it."""
    script = textwrap.dedent("""
        import os, socket, sys, time, torch, torch.distributed as dist
        from slime.utils.distributed import init_custom_process_group, broadcast, destroy_custom_process_group
        rank, tmp = int(sys.argv[1]), sys.argv[2]
        port_file = os.path.join(tmp, "port")
        if rank == 0:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", world_size=1, rank=0)
            with socket.socket() as s:  # pick the port here: no window for another process to take it
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            open(port_file + ".tmp", "w").write(str(port))
            os.replace(port_file + ".tmp", port_file)
        else:
            while not os.path.exists(port_file):
                time.sleep(0.01)
            port = int(open(port_file).read())
        pg = init_custom_process_group("127.0.0.1", port, 2, rank, "sync", backend="gloo", timeout_s=60)
        t = torch.arange(5.0) if rank == 0 else torch.full((5,), float("nan"))
        broadcast(t, 0, pg)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], t
        dist.barrier(group=pg)  # both sides done with the group's traffic before either tears it down
        destroy_custom_process_group(pg)
        # drop the group (as the engine and the trainer do): its gloo worker threads are joined now. A group still
        # referenced at exit is freed during interpreter shutdown, where a worker thread releasing its last
        # broadcast's tensor needs the GIL, is ended by Python, and the process aborts ('terminate called
        # without an active exception', seen under load)
        del pg
        if rank == 0:
            x = torch.ones(3)
            dist.all_reduce(x)  # the default world still works, and is still size 1
            assert dist.get_world_size() == 1 and x.tolist() == [1.0, 1.0, 1.0]
            dist.destroy_process_group()
        else:
            assert not dist.is_initialized()
        print("ok", rank, flush=True)
        if rank == 0:  # the trainer's side outlives the engine's, as in a run: stay until rank 1 has exited
            sys.stdin.read()
    """)
    procs = []
    for rank in (0, 1):
        out = open(tmp_path / f"out{rank}", "w")
        procs.append((subprocess.Popen([sys.executable, "-c", script, str(rank), str(tmp_path)],
                                       stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT, cwd=ROOT), out))
    # rank 1 first, as a trainer outlives its engines
    for rank, (p, out) in ((1, procs[1]), (0, procs[0])):
        if rank == 0:
            p.stdin.close()
        assert p.wait(timeout=120) == 0, (tmp_path / f"out{rank}").read_text()[-2000:]
        out.close()
        assert f"ok {rank}" in (tmp_path / f"out{rank}").read_text()


def test_sglang_generate_extras_and_get_weights_by_name(served, ckpts):
    """SGLang's custom_params are accepted (ignored without a processor, as SGLang does); a custom logit
    processor and a malformed return_routed_experts / routed_experts_start_len get one clear 400; /get_weights_by_name answers as SGLang does
    (float32 nested lists, first dimension truncated), by HF name."""
    server, client = served
    prompt = _prompts(3, lengths=(5,))[0]
    greedy = {"max_new_tokens": 4, "temperature": 0}
    plain = client.generate(prompt, greedy)
    custom = client.generate(prompt, {**greedy, "custom_params": {"thinking_budget": 3}})
    assert custom["output_ids"] == plain["output_ids"]
    for extra, needle in (({"custom_logit_processor": "x"}, "custom_logit_processor is not supported"),
                          ({"return_routed_experts": "yes"}, "return_routed_experts must be true/false"),
                          ({"return_routed_experts": True, "routed_experts_start_len": 99},
                           "routed_experts_start_len must be an integer in [0, 5]"),
                          ({"sampling_params": {"custom_params": 3}}, "custom_params must be a JSON object")):
        with pytest.raises(EngineError) as e:
            client.post("/generate", {"input_ids": prompt, "sampling_params": greedy, **extra})
        assert e.value.status == 400 and needle in e.value.message
    ref = _hf(ckpts["lite0"]).get_parameter("model.embed_tokens.weight").detach()
    got = client.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 3})
    assert torch.equal(torch.tensor(got), ref[:3].float())
    with pytest.raises(EngineError) as e:
        client.post("/get_weights_by_name", {"name": "no.such.weight"})
    assert e.value.status == 400 and "unknown weight" in e.value.message
