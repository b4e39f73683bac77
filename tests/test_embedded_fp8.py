"""Block-FP8 checkpoints served by the embedded engine (slime/backends/embedded/fp8_checkpoint.py): the layout
GLM-5.3-Flash publishes (e4m3 `X.weight` + float32 `X.weight_scale_inv` per block, config.json
quantization_config with weight_block_size and modules_to_not_convert), written here from tiny random checkpoints
with the project's quantizer (slime.utils.fp8_blocks.quantize) in blocks that divide none of the tiny shapes.

- The FP8 engine holds exactly the float64-checked dequantization (w = q * scale_inv per block, partial blocks
  included) and its sampled tokens and log-probs equal, bit for bit, an engine serving those dequantized
  weights from a float32 checkpoint, and the trainer's log-probs of its samples (--hf-checkpoint reads the same
  checkpoint dequantized) within 5e-5.
- Against the unquantized model the teacher-forced log-probs stay within 0.25 nats (e4m3 keeps 3 mantissa bits;
  measured max ~0.05 on these tiny random models).
- A malformed checkpoint (missing scale, wrong scale shape, FP8 in an unconverted module) is refused in one line
  naming the tensor; FP8 weight updates (the sender's quantize_named pairs) land dequantized, bad ones change
  nothing.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.utils.fp8_blocks import expand_blocks, quantize, quantize_named, scale_name

# (model_type, weight_block_size): blocks that no tiny dimension is a multiple of (and the published 128 x 128,
# larger than every tiny dimension: one partial block per weight)
FAMILIES = [("glm5_next", [16, 24]), ("glm_moe_dsa", [128, 128])]
NOT_CONVERTED = ["lm_head", "mlp.gate", "model.visual"]


def _is_fp8(name: str, t: torch.Tensor) -> bool:
    """The linear projections (attention, KDA, experts, shared experts, dense MLPs); routers, embeddings, norms,
    convs and the vision tower stay high precision as the config's modules_to_not_convert says."""
    return t.dim() == 2 and name.endswith("_proj.weight") and ".visual." not in name


def _write(src: str, dst: str, tensors: dict, quantization: dict | None) -> str:
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(dst, f))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization:
        config["quantization_config"] = quantization
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def _float64_dequantized(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    rows, cols = q.shape
    return (q.double() * expand_blocks(s.double(), rows, cols, tuple(block))).float()


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _ in FAMILIES])
def checkpoints(request, tmp_path_factory):
    """{"ref": unquantized float32, "fp8": block FP8, "deq": the FP8 weights dequantized, float32} and the
    float64-checked dequantized FP8 tensors."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    model_type, block = request.param
    root = tmp_path_factory.mktemp(f"fp8_{model_type}")
    ref = write_tiny_checkpoint(str(root / "ref"), model_type, seed=5)
    tensors = load_file(os.path.join(ref, "model.safetensors"))
    fp8, deq, expected = {}, {}, {}
    for name, t in tensors.items():
        if _is_fp8(name, t):
            q, s = quantize(t, tuple(block))
            fp8[name], fp8[scale_name(name)] = q, s
            deq[name] = expected[name] = _float64_dequantized(q, s, block)
        else:
            fp8[name] = deq[name] = t
    assert expected and any(s % b for name in expected for s, b in zip(tensors[name].shape, block))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block,
             "modules_to_not_convert": NOT_CONVERTED}
    return {"type": model_type, "block": block, "quant": quant, "ref": ref, "expected": expected,
            "fp8": _write(ref, str(root / "fp8"), fp8, quant), "deq": _write(ref, str(root / "deq"), deq, None)}


def _engine(path):
    from slime.backends.embedded import EmbeddedEngine, EngineConfig

    return EmbeddedEngine(EngineConfig(model_path=path, batch_wait_s=0.0, max_batch_wait_s=0.0))


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 11, 7)]


def _wave(engine):
    reqs = [engine.make_request(p, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7 + i,
                                    "ignore_eos": True}, return_logprob=True) for i, p in enumerate(_prompts())]
    engine.submit_batch(reqs)
    for r in reqs:
        assert r.done.wait(120)
    return [(r.output_ids, r.logprobs) for r in reqs]


@torch.no_grad()
def _teacher_forced(engine, seqs):
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = engine.model(input_ids=ids).logits.float()
        out.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def test_fp8_checkpoint_serves_its_dequantized_weights(checkpoints):
    from model_conformance import trainer_logprobs

    from slime.backends.megatron import load_hf_model

    engines = {k: _engine(checkpoints[k]) for k in ("fp8", "deq", "ref")}
    try:
        fp8, deq = engines["fp8"], engines["deq"]
        assert not hasattr(fp8.model.config, "quantization_config")
        for name in fp8.name_map.checkpoint_names():
            assert torch.equal(fp8.name_map.resolve(name), deq.name_map.resolve(name)), name
        for name, want in checkpoints["expected"].items():
            assert torch.equal(fp8.name_map.resolve(name), want), name
        got, same = _wave(fp8), _wave(deq)
        assert got == same  # tokens and log-probs bit for bit
        # the trainer reads the same checkpoint dequantized (hf_io): its teacher-forced log-probs of the engine's
        # samples agree as for unquantized checkpoints (5e-5: KV-cached decode against a packed full pass)
        trainer = trainer_logprobs(load_hf_model(checkpoints["fp8"]), _prompts(), [ids for ids, _ in got])
        for (_, lps), want in zip(got, trainer):
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float32), want, rtol=0, atol=5e-5)
        seqs = [p + ids for p, (ids, _) in zip(_prompts(), got)]
        quantized, unquantized = _teacher_forced(fp8, seqs), _teacher_forced(engines["ref"], seqs)
        worst = max((a - b).abs().max().item() for a, b in zip(quantized, unquantized))
        print(f"{checkpoints['type']}: max |log-prob(FP8) - log-prob(unquantized)| = {worst:.3g}")
        assert 0 < worst <= 0.25, worst
    finally:
        for e in engines.values():
            e.shutdown()


def _broken(checkpoints, tmp_path, edit, quant=None) -> str:
    tensors = load_file(os.path.join(checkpoints["fp8"], "model.safetensors"))
    edit(tensors)
    return _write(checkpoints["ref"], str(tmp_path / "broken"), tensors, quant or checkpoints["quant"])


def _first_fp8(checkpoints, part: str = "") -> str:
    return sorted(n for n in checkpoints["expected"] if part in n)[0]


@pytest.mark.parametrize("case", ["missing_scale", "scale_shape", "unconverted_module", "orphan_scale"])
def test_malformed_fp8_checkpoint_is_refused_in_one_line(checkpoints, tmp_path, case):
    from slime.backends.embedded.errors import BadRequest

    name = _first_fp8(checkpoints)
    quant = None
    if case == "missing_scale":
        edit, match = (lambda t: t.pop(scale_name(name))), f"{name} is float8 without its {scale_name(name)}"
    elif case == "scale_shape":
        def edit(t):
            t[scale_name(name)] = t[scale_name(name)][:-1] if t[scale_name(name)].shape[0] > 1 else \
                torch.ones(2, *t[scale_name(name)].shape[1:])
        match = f"{scale_name(name)} has shape"
    elif case == "unconverted_module":
        module = name.rpartition(".")[0]
        quant = {**checkpoints["quant"], "modules_to_not_convert": NOT_CONVERTED + [module]}
        edit, match = (lambda t: None), "modules_to_not_convert keeps its module unquantized"
    else:
        edit, match = (lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(1, 1)})), "scales no float8 weight"
    path = _broken(checkpoints, tmp_path, edit, quant)
    with pytest.raises(BadRequest, match=match) as e:
        _engine(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"cannot serve {path}: malformed block-FP8 weights")
    assert "re-quantize" in message


def test_standalone_engine_refuses_a_malformed_fp8_checkpoint_with_exit_2(checkpoints, tmp_path):
    """`python -m slime.backends.embedded` on a checkpoint whose scale is missing: one line on stderr, exit 2."""
    import subprocess
    import sys

    if checkpoints["type"] != "glm5_next":
        pytest.skip("one family suffices for the command line")
    name = _first_fp8(checkpoints)
    path = _broken(checkpoints, tmp_path, lambda t: t.pop(scale_name(name)))
    env = {**os.environ, "SLIME_ENGINE_TOKEN": "t", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "slime.backends.embedded", "--model-path", path, "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("slime: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [f"slime: cannot serve {path}: malformed block-FP8 weights: {name} is float8 without its "
                     f"{scale_name(name)}; re-quantize it with slime.utils.fp8_blocks.quantize (e4m3 + float32 "
                     f"weight_scale_inv per {checkpoints['block']} block)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_fp8_weight_updates_land_dequantized(checkpoints):
    from slime.backends.embedded.errors import BadRequest
    from slime.utils.fp8_blocks import Fp8BlockFormat
    from slime.utils.weight_checksum import named_checksums

    engine = _engine(checkpoints["fp8"])
    try:
        g = torch.Generator().manual_seed(3)
        names = sorted(checkpoints["expected"])[:4] + ["lm_head.weight"]
        trained = [(n, engine.name_map.resolve(n) + 0.01 * torch.randn(engine.name_map.resolve(n).shape, generator=g))
                   for n in names if n in engine.name_map]
        fmt = Fp8BlockFormat(tuple(checkpoints["block"]))
        sent = list(quantize_named(trained, set(checkpoints["expected"]), fmt))
        assert any(t.dtype == torch.float8_e4m3fn for _, t in sent)
        assert engine.update_from_named_tensors(sent, weight_version="1") == len(trained)
        for n, w in trained:
            want = _float64_dequantized(*quantize(w, fmt.block), fmt.block) if n in checkpoints["expected"] else w
            assert torch.equal(engine.name_map.resolve(n), want), n
        # the read-back (/get_weights_checksum) answers what the sender checksums: the pairs as sent
        assert engine.weights_checksum([n for n, _ in sent]) == named_checksums(sent)
        before = {n: engine.name_map.resolve(n).clone() for n, _ in trained}
        bad = [(n, t[:-1] if n.endswith("_scale_inv") else t) for n, t in sent]
        with pytest.raises(BadRequest, match="nothing changed: malformed block-FP8 weights"):
            engine.update_from_named_tensors(bad)
        assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in before.items())
        assert engine.weights_checksum([n for n, _ in sent]) == named_checksums(sent)
        assert engine.update_from_disk(checkpoints["fp8"]) > 0  # back to the checkpoint, read as at load
        for n, want in checkpoints["expected"].items():
            assert torch.equal(engine.name_map.resolve(n), want), n
        stored = load_file(os.path.join(checkpoints["fp8"], "model.safetensors"))
        assert engine.weights_checksum([n for n, _ in sent]) == named_checksums((n, stored[n]) for n, _ in sent)
    finally:
        engine.shutdown()



def test_fp8_weights_over_a_collective_group_land_dequantized(checkpoints, monkeypatch):
    """update_weights_from_distributed with quantize_named pairs, in both wire layouts (one broadcast per tensor,
    flattened_bucket): received as sent, each weight dequantized before the commit; a pair whose scale grid does
    not fit is refused whole after its broadcasts are received (the sender never hangs). The group's broadcast is
    replaced by a copy from the sender's tensors (the collective itself: tests/test_embedded_engine.py)."""
    import slime.utils.distributed as distributed
    from slime.backends.embedded.errors import BadRequest
    from slime.utils.fp8_blocks import Fp8BlockFormat
    from slime.utils.weight_checksum import named_checksums

    if checkpoints["type"] != "glm_moe_dsa":
        pytest.skip("one family suffices for the wire path")
    wire: list[torch.Tensor] = []
    monkeypatch.setattr(distributed, "broadcast", lambda buf, src, group: buf.copy_(wire.pop(0)))
    engine = _engine(checkpoints["fp8"])
    engine._groups["fp8"] = object()

    def send(named, load_format=None):
        if load_format == "flattened_bucket":
            wire.append(torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named]))
        else:
            wire.extend(t.contiguous() for _, t in named)
        try:
            return engine.update_from_distributed([n for n, _ in named], [str(t.dtype) for _, t in named],
                                                  [list(t.shape) for _, t in named], "fp8", load_format=load_format)
        finally:
            assert not wire  # every broadcast received, refused or not

    try:
        g = torch.Generator().manual_seed(4)
        names = sorted(checkpoints["expected"])[:3] + ["model.norm.weight"]
        trained = [(n, engine.name_map.resolve(n) + 0.01 * torch.randn(engine.name_map.resolve(n).shape, generator=g))
                   for n in names]
        fmt = Fp8BlockFormat(tuple(checkpoints["block"]))
        sent = list(quantize_named(trained, set(checkpoints["expected"]), fmt))
        assert sum(t.dtype == torch.float8_e4m3fn for _, t in sent) == 3
        before = {n: engine.name_map.resolve(n).clone() for n, _ in trained}
        with pytest.raises(BadRequest, match="nothing changed: malformed block-FP8 weights"):
            send([(n, torch.ones(3, 3) if n.endswith("_scale_inv") else t) for n, t in sent])
        assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in before.items())
        for load_format in (None, "flattened_bucket"):
            assert send(sent, load_format) == len(trained)
            for n, w in trained:
                want = _float64_dequantized(*quantize(w, fmt.block), fmt.block) if n in checkpoints["expected"] else w
                assert torch.equal(engine.name_map.resolve(n), want), n
            # the read-back after a broadcast: the sender's checksums (BroadcastStage's) of what it sent
            assert engine.weights_checksum([n for n, _ in sent]) == named_checksums(sent), load_format
            trained = [(n, w + 0.01) for n, w in trained]
            sent = list(quantize_named(trained, set(checkpoints["expected"]), fmt))
    finally:
        engine._groups.clear()
        engine.shutdown()



def test_device_auto_dtype_keeps_the_checkpoints_high_precision(checkpoints, tmp_path):
    """--dtype auto on a device keeps the checkpoint's dtype: for an FP8 checkpoint the one config.json names for
    its unquantized tensors (bfloat16 here). Every parameter has the dtype and value transformers' from_pretrained
    gives the dequantized checkpoint under the same config (its float32-kept modules included): the FP8 weights
    dequantized in float32 and rounded once."""
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded.model_loading import load_pretrained

    if checkpoints["type"] != "glm_moe_dsa":
        pytest.skip("one family suffices")
    paths = {}
    for kind in ("fp8", "deq"):
        paths[kind] = shutil.copytree(checkpoints[kind], str(tmp_path / kind))
        with open(os.path.join(paths[kind], "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(paths[kind], "config.json"), "w") as f:
            json.dump(config | {"dtype": "bfloat16"}, f)
    got = dict(load_pretrained(paths["fp8"], dtype="auto").named_parameters())
    want = dict(AutoModelForCausalLM.from_pretrained(paths["deq"], dtype="auto").named_parameters())
    assert got.keys() == want.keys() and torch.bfloat16 in {p.dtype for p in got.values()}
    for name, p in got.items():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name


def test_fp8_update_with_return_checksums_is_applied_with_the_senders_checksums_or_not_at_all(checkpoints,
                                                                                              monkeypatch):
    """/update_weights_from_tensor with return_checksums on quantize_named pairs, in both payload layouts: the
    reply's checksums are the sender's over the bytes it sent (each e4m3 weight and its weight_scale_inv, as
    SharedBucketSender computes them), the weights land dequantized. A failure, a malformed pair or one injected
    into the checksums, answers one error and changes nothing (weights and weight_version)."""
    import slime.utils.weight_checksum as weight_checksum
    from slime.backends.embedded import server
    from slime.backends.embedded.errors import BadRequest
    from slime.utils.fp8_blocks import Fp8BlockFormat
    from slime.utils.http_client import EngineClient

    if checkpoints["type"] != "glm5_next":
        pytest.skip("one family suffices for the endpoint")
    engine = _engine(checkpoints["fp8"])
    client = EngineClient("http://127.0.0.1:9", "t")  # never reached: post routes in-process
    client.post = lambda path, body: server._ROUTES[path](engine, {**body, "return_checksums": True})[1]
    try:
        g = torch.Generator().manual_seed(6)
        names = sorted(checkpoints["expected"])[:3] + ["lm_head.weight"]
        fmt = Fp8BlockFormat(tuple(checkpoints["block"]))
        for version, load_format in (("1", None), ("2", "flattened_bucket")):
            trained = [(n, engine.name_map.resolve(n) + 0.01 * torch.randn(engine.name_map.resolve(n).shape,
                                                                            generator=g)) for n in names]
            sent = list(quantize_named(trained, set(checkpoints["expected"]), fmt))
            assert sum(t.dtype == torch.float8_e4m3fn for _, t in sent) == 3
            reply = client.update_weights_from_tensor(sent, load_format=load_format, weight_version=version)
            expected = weight_checksum.named_checksums(sent)
            assert len(expected) == 7 and reply["checksums"] == expected, load_format
            assert weight_checksum.mismatches(expected, reply["checksums"]) == []  # the controller's verify
            assert reply["weight_version"] == version and reply["message"] == "updated 4 weights"
            for n, w in trained:
                want = _float64_dequantized(*quantize(w, fmt.block), fmt.block) if n in checkpoints["expected"] else w
                assert torch.equal(engine.name_map.resolve(n), want), n
        before = {n: engine.name_map.resolve(n).clone() for n in names}
        moved = [(n, w + 0.5) for n, w in trained]
        sent = list(quantize_named(moved, set(checkpoints["expected"]), fmt))
        bad = [(n, t[:-1] if n.endswith("_scale_inv") and t.shape[0] > 1 else torch.ones(2, *t.shape[1:])
                if n.endswith("_scale_inv") else t) for n, t in sent]
        with pytest.raises(BadRequest, match="nothing changed: malformed block-FP8 weights") as e:
            client.update_weights_from_tensor(bad, weight_version="3")
        assert "\n" not in str(e.value)

        accepted = list(quantize_named(trained, set(checkpoints["expected"]), fmt))
        real = weight_checksum.named_checksums
        for failing in range(1, 5):  # the pairs as received, each weight as it lands, the other tensors
            calls = []

            def broken(named, failing=failing, calls=calls):
                calls.append(1)
                if len(calls) == failing:
                    raise RuntimeError("checksum kernel failed")
                return real(named)

            monkeypatch.setattr(weight_checksum, "named_checksums", broken)
            with pytest.raises(RuntimeError, match="checksum kernel failed"):
                client.update_weights_from_tensor(sent, weight_version="4")
            monkeypatch.setattr(weight_checksum, "named_checksums", real)
            assert engine.weight_version == "2"
            assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in before.items())
            assert engine.weights_checksum(sorted(expected)) == real(accepted)  # version 2's receipts, kept whole
    finally:
        engine.shutdown()


def _served(engine):
    from slime.backends.embedded import EngineHTTPServer
    from slime.backends.megatron.weight_sync import EngineEndpoint

    server = EngineHTTPServer(engine, "tok", 0)
    server.start_in_thread()
    return server, EngineEndpoint(server.url, token="tok")


def test_fp8_disk_sync_with_check_weight_sync_reads_back_what_the_sender_checksummed(checkpoints, tmp_path):
    """--update-weight-mode disk with --check-weight-sync, the trainer's FP8 weights sent as the checkpoint stores
    them (factory.in_checkpoint_format: e4m3 + weight_scale_inv): the read-back (/get_weights_checksum of every
    sent name, scales included) equals the sender's checksums of the bytes it wrote, the weights land
    dequantized; a second sync of other values verifies too (the engine answers what it holds now)."""
    from slime.backends.megatron.weight_sync import WeightSync
    from slime.backends.megatron.weight_sync.factory import in_checkpoint_format

    if checkpoints["type"] != "glm5_next":
        pytest.skip("one family suffices for the read-back")
    engine = _engine(checkpoints["fp8"])
    server, endpoint = _served(engine)
    block, fp8 = tuple(checkpoints["block"]), set(checkpoints["expected"])
    try:
        held = load_file(os.path.join(checkpoints["deq"], "model.safetensors"))
        g = torch.Generator().manual_seed(8)
        for version in (1, 2):
            trained = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in sorted(held.items())}
            names = sorted(trained)
            buckets = [[(n, trained[n]) for n in names[i:i + 7]] for i in range(0, len(names), 7)]
            ws = WeightSync("disk", lambda buckets=buckets: in_checkpoint_format(iter(buckets), dict.fromkeys(fp8, block)),
                            [endpoint], rank=0, disk_dir=str(tmp_path / "sync"))
            metrics = ws.sync(version=version)
            assert metrics["weight_sync/checked_tensors"] == len(trained) + len(fp8)
            for n, w in trained.items():
                want = _float64_dequantized(*quantize(w, block), block) if n in fp8 else w
                assert torch.equal(engine.name_map.resolve(n), want), n
            assert engine.weight_version == str(version)
            ws.close()
    finally:
        server.stop()
        engine.shutdown()


def test_fp8_read_back_follows_the_weights_the_engine_holds(checkpoints):
    """After an FP8 update the read-back answers each pair as sent. A weight sent again in high precision answers
    its new bytes and its scale is no longer known; a weight whose bytes changed by another route answers its live
    checksum and its scale is refused in one line; released weights keep no scale."""
    import re

    from slime.backends.embedded.errors import BadRequest
    from slime.utils.fp8_blocks import Fp8BlockFormat
    from slime.utils.weight_checksum import named_checksums

    if checkpoints["type"] != "glm5_next":
        pytest.skip("one family suffices")
    engine = _engine(checkpoints["fp8"])
    resolve = engine.name_map.resolve
    try:
        g = torch.Generator().manual_seed(9)
        a, b, c = sorted(checkpoints["expected"])[:3]
        trained = [(n, resolve(n) + 0.01 * torch.randn(resolve(n).shape, generator=g)) for n in (a, b, c)]
        sent = list(quantize_named(trained, {a, b, c}, Fp8BlockFormat(tuple(checkpoints["block"]))))
        engine.update_from_named_tensors(sent)
        assert engine.weights_checksum([n for n, _ in sent]) == named_checksums(sent)
        high = [(a, trained[0][1] + 0.02)]
        engine.update_from_named_tensors(high)
        assert engine.weights_checksum([a]) == named_checksums(high)
        with pytest.raises(BadRequest, match=re.escape(f"unknown weights ['{scale_name(a)}']")):
            engine.weights_checksum([scale_name(a)])
        with torch.no_grad():
            resolve(b).add_(1.0)
        with pytest.raises(BadRequest, match=re.escape(f"{scale_name(b)}: {b} changed since")) as e:
            engine.weights_checksum([b, scale_name(b)])
        assert "\n" not in str(e.value)
        assert engine.weights_checksum([b]) == named_checksums([(b, resolve(b))])
        pair_c = [(n, t) for n, t in sent if n in (c, scale_name(c))]
        assert engine.weights_checksum([c, scale_name(c)]) == named_checksums(pair_c)
        engine.release_memory(["weights"])
        engine.resume_memory(["weights"])
        with pytest.raises(BadRequest, match="unknown weights"):
            engine.weights_checksum([scale_name(c)])
        assert engine.weights_checksum([c]) == named_checksums([(c, resolve(c))])
    finally:
        engine.shutdown()
