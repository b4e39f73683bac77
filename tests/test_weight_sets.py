"""Colocated weight sync through the embedded engine's weight sets (slime.backends.embedded.weight_sets):
the trainer writes the engine's target set, the engine switches to it on commit."""

import pytest
import torch

from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync, WeightSyncError
from slime.utils import weight_checksum


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from glm5_helpers import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("sets") / "glm", "glm_moe_dsa", seed=3)


@pytest.fixture
def engines(ckpt):
    started = []

    def start():
        engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
        server = EngineHTTPServer(engine, "tok", 0)
        server.start_in_thread()
        started.append((engine, server))
        return engine, EngineEndpoint(server.url, token="tok")

    yield start
    for engine, server in started:
        server.stop()
        engine.shutdown()


def trainer_weights(ckpt, seed):
    """The checkpoint moved on by a seeded step, expert weights as the GLM export hands them out: transposed
    views of megatron's per-layer [E, H, 2I] / [E, I, H] storage."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    w = {n: t + 0.01 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in load_file(f"{ckpt}/model.safetensors").items()}
    layers = sorted({n.split(".experts.")[0] for n in w if ".experts." in n})
    for layer in layers:
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in w if n.startswith(layer + ".experts.")})
        p = [f"{layer}.experts.{e}." for e in experts]
        w1 = torch.stack([torch.cat([w[q + "gate_proj.weight"].t(), w[q + "up_proj.weight"].t()], 1) for q in p])
        w2 = torch.stack([w[q + "down_proj.weight"].t() for q in p])
        ffn = w1.shape[2] // 2
        for i, q in enumerate(p):
            w[q + "gate_proj.weight"], w[q + "up_proj.weight"] = w1[i][:, :ffn].t(), w1[i][:, ffn:].t()
            w[q + "down_proj.weight"] = w2[i].t()
    assert any(not t.is_contiguous() for t in w.values())
    return w


def buckets(weights, per_bucket=40, fail_after=None):
    def export():
        items = list(weights.items())
        for i in range(0, len(items), per_bucket):
            if fail_after is not None and i >= fail_after:
                raise RuntimeError("export failed")
            yield items[i:i + per_bucket]
    return export


def assert_holds(engine, weights):
    for name, t in weights.items():
        assert torch.equal(engine.name_map.resolve(name), t), name


def live_sets(engine):
    return set(engine._weight_sets.live)


def engine_checksums(engine, names):
    return weight_checksum.named_checksums((n, engine.name_map.resolve(n)) for n in names)


def record_posts(ws):
    """The paths `ws` posts to, in order (a list filled as it syncs)."""
    calls, post = [], ws.post
    ws.post = lambda e, path, *a, **k: (calls.append(path), post(e, path, *a, **k))[1]
    return calls


def synced_engine(engines, weights, **sync_kwargs):
    """(engine, its endpoint, a WeightSync that has written `weights` into it once)."""
    engine, ep = engines()
    ws = WeightSync("ipc", buckets(weights), [ep], rank=0, **sync_kwargs)
    ws.sync(1)
    return engine, ep, ws


def test_weight_sets_are_bit_exact_alternate_and_give_the_same_logprobs(ckpt, engines):
    sets_engine, sets_ep = engines()
    bucket_engine, bucket_ep = engines()
    w = trainer_weights(ckpt, seed=1)
    ws = WeightSync("ipc", buckets(w), [sets_ep], rank=0)
    ref = WeightSync("ipc", buckets(w), [bucket_ep], rank=0)
    ref.takes_weight_sets = lambda engine: False
    calls = record_posts(ws)
    assert ws.sync(1)["weight_sync/checked_tensors"] == len(w)
    ref.sync(1)
    assert "/update_weights_from_tensor" not in calls and calls.count("/commit_weight_sets") == 1
    assert_holds(sets_engine, w)
    assert live_sets(sets_engine) == {0}  # every tensor now lives in set 0
    experts = sets_engine.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.stride()[-2] == 1  # stored as the trainer stores it ([E, H, 2I])

    # weight sets in the engine's own (HF) layout: the forward is unchanged
    hf_engine, _, hf = synced_engine(engines, w, expert_layout="hf")
    assert_holds(hf_engine, w)
    assert hf_engine.model.model.layers[1].mlp.experts.gate_up_proj.is_contiguous()

    prompt = [3, 17, 5, 9, 22, 4]
    a, b, c = (e.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0}, return_logprob=True)
               for e in (sets_engine, bucket_engine, hf_engine))
    assert a.output_ids == b.output_ids == c.output_ids
    assert c.logprobs == b.logprobs  # same weights, same layout: bit-identical
    # float32 matmuls over the other storage order round differently, nothing more
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    hf.close()

    w2 = trainer_weights(ckpt, seed=2)
    ws.export = buckets(w2)
    calls.clear()
    ws.sync(2)
    assert "/attach_weight_sets" not in calls  # attached once
    assert_holds(sets_engine, w2)
    assert live_sets(sets_engine) == {1}  # the second sync wrote the other set
    ws.export = buckets(w)
    ws.sync(3)
    assert live_sets(sets_engine) == {0} and sets_engine.weight_version == "3"
    assert_holds(sets_engine, w)
    ws.close()
    ref.close()


def test_failed_or_refused_weight_set_update_changes_nothing(ckpt, engines):
    w1, w2 = trainer_weights(ckpt, seed=1), trainer_weights(ckpt, seed=2)
    engine, ep, ws = synced_engine(engines, w1)
    before = engine_checksums(engine, w1)
    prompt = [3, 17, 5, 9]
    expected = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0}).output_ids

    ws.export = buckets(w2, fail_after=40)  # half of the target set written, then the export fails
    with pytest.raises(RuntimeError, match="export failed"):
        ws.sync(2)
    after = engine_checksums(engine, w1)
    assert after == before and engine.weight_version == "1"
    assert engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0}).output_ids == expected

    # a commit whose checksums do not match what is in the target set is refused before any switch
    writer = next(iter(ws.weight_sets.writers.values()))
    state = engine.weight_sets_state(writer.layout_id)
    writer.begin(state)
    for name, t in w2.items():
        writer.add(name, t)
    wrong = weight_checksum.named_checksums(writer.written())
    wrong[next(iter(wrong))][1] += 1
    with pytest.raises(WeightSyncError, match="differ from the trainer"):
        ws.post(ep, "/commit_weight_sets", {"layout_id": writer.layout_id, "epoch": state["epoch"],
                                            "names": writer.names, "checksums": wrong})
    assert engine_checksums(engine, w1) == before
    with pytest.raises(WeightSyncError, match="epoch"):
        ws.post(ep, "/commit_weight_sets", {"layout_id": writer.layout_id, "epoch": state["epoch"] - 1,
                                            "names": writer.names})

    ws.export = buckets(w2)  # the next sync writes the same target set again and succeeds
    ws.sync(3)
    assert_holds(engine, w2)
    assert live_sets(engine) == {1}

    # released weights leave the sets; after the resume the trainer attaches them again
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    calls = record_posts(ws)
    ws.export = buckets(w1)
    ws.sync(4)
    assert "/attach_weight_sets" in calls
    assert_holds(engine, w1)
    ws.close()


def test_an_update_of_some_experts_keeps_the_other_experts_of_their_fused_tensor(ckpt, engines):
    w1, w2 = trainer_weights(ckpt, seed=1), trainer_weights(ckpt, seed=2)
    engine, ep, ws = synced_engine(engines, w1)
    some = {n: t for n, t in w2.items() if ".experts.1." in n or n.endswith("norm.weight")}
    assert len({n.split(".experts.")[0] for n in some if ".experts." in n}) >= 1
    ws.export = buckets(some)
    ws.sync(2)  # the target set gets the other experts from the live one before the switch
    assert_holds(engine, {**w1, **some})
    assert live_sets(engine) == {0, 1}  # touched tensors moved to set 1, the rest stayed in set 0
    ws.export = buckets(w2)
    ws.sync(3)
    assert_holds(engine, w2)
    ws.close()
