"""Weight sync client against a stand-in engine that speaks the SGLang endpoints it uses."""

import base64
import logging
import time

import pytest
import torch

from json_http import JsonHandler, serve
from slime.accelerator import get_accelerator
from slime.accelerator.ipc import deserialize_flattened_bucket, deserialize_named_tensors
from slime.utils.tensor_bucket import FlattenedTensorMetadata, reconstruct
from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync, WeightSyncError, default_get, resolve_mode
from slime.utils import weight_checksum


class FakeEngine:
    """Holds named weights; applies /update_weights_from_tensor; reports checksums; logs calls."""

    def __init__(self, weights, checksums=True, flat=False, delay=0.0, update_sums=False):
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.checksums = checksums  # False: an engine without slime's /get_weights_checksum (SGLang)
        self.flat = flat  # True: takes load_format flattened_bucket (the embedded engine's capability)
        self.delay = delay  # seconds to wait before reading the buffers (a slow engine)
        self.update_sums = update_sums  # answers updates with checksums when asked (return_checksums)
        self.formats = []  # load_format of every update
        self.handles = []  # (storage data_ptr of every received tensor) per update
        self.payloads = []  # per update: per TP rank, the (name, tensor) list it opened
        self.calls = []
        self.gets = []
        self.corrupt = None  # name to perturb after updates (simulates a broken load)
        self.refuse = False
        engine = self

        class Handler(JsonHandler):
            def do_GET(self):
                engine.gets.append(self.path)
                if self.path == "/get_model_info":
                    info = {"model_path": "/m", "weight_version": "default"}
                    info = {**info, "weights_checksum": True} if engine.checksums else info
                    info = {**info, "flattened_bucket": True} if engine.flat else info
                    self.reply(200, {**info, "update_checksums": True} if engine.update_sums else info)
                else:
                    self.reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = self.body()
                engine.calls.append(self.path)
                if self.path == "/get_weights_checksum" and not engine.checksums:
                    return self.reply(404, {"detail": "Not Found"})
                self.reply(200, engine.handle(self.path, body))

        self.server, self.url = serve(Handler)

    def handle(self, path, body):
        if path == "/update_weights_from_tensor":
            if self.refuse:
                return {"success": False, "message": "shape mismatch for x"}
            acc = get_accelerator()
            self.formats.append(body.get("load_format"))
            per_rank = []  # what each engine TP rank opened from its own payload
            for payload in body["serialized_named_tensors"]:
                data = base64.b64decode(payload)
                if body.get("load_format") == "flattened_bucket":
                    per_rank.append(reconstruct(*deserialize_flattened_bucket(data, acc.ipc_rebuild_allowlist())))
                else:
                    per_rank.append(deserialize_named_tensors(data, acc.ipc_rebuild_allowlist()))
            self.payloads.append(per_rank)
            named = per_rank[0]
            self.handles.append(sorted({t.untyped_storage().data_ptr() for _, t in named}))
            time.sleep(self.delay)
            for name, t in named:
                self.weights[name].copy_(t)
            if self.corrupt:
                self.weights[self.corrupt].view(-1)[0] += 1e-3
            if body.get("return_checksums"):
                assert self.update_sums, "asked for checksums it does not advertise"
                return {"success": True, "checksums": weight_checksum.named_checksums(
                    (n, self.weights[n]) for n, _ in named)}
            return {"success": True, "message": ""}
        if path == "/get_weights_checksum":
            names = body.get("names") or sorted(self.weights)
            return {"checksums": weight_checksum.named_checksums((n, self.weights[n]) for n in names if n in self.weights)}
        return {"success": True}


@pytest.fixture
def trainer_weights():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g), "b.bias": torch.randn(13, generator=g),
            "c.weight": torch.randn(3, 4, 2, generator=g)}


def _sync(engines, weights, bucket_names, **kwargs):
    def export():
        for names in bucket_names:
            yield [(n, weights[n]) for n in names]
    return WeightSync("ipc", export, [EngineEndpoint(e.url) for e in engines], rank=0, **kwargs)


def test_ipc_sync_updates_engine_and_verifies(trainer_weights):
    engines = [FakeEngine({k: torch.full_like(v, float("nan")) for k, v in trainer_weights.items()}) for _ in range(2)]
    ws = _sync(engines, trainer_weights, [["a.weight", "b.bias"], ["c.weight"]])
    metrics = ws.sync(version=1)
    for e in engines:
        for k, v in trainer_weights.items():
            assert torch.equal(e.weights[k], v)
        assert e.calls[:2] == ["/pause_generation", "/update_weights_from_tensor"]  # one buffer holds everything
        assert e.formats == ["flattened_bucket"]  # SGLang's FlattenedTensorBucket, whatever the engine
        assert e.calls[-3:] == ["/flush_cache", "/continue_generation", "/get_weights_checksum"]
    assert metrics["weight_sync/checked_tensors"] == 3
    assert metrics["weight_sync/bytes"] == sum(v.numel() * 4 for v in trainer_weights.values())


def _mixed_weights(seed):
    """float32 and bfloat16 tensors of odd sizes, one transposed view (as the GLM export yields expert
    weights) and one larger than the 4 KiB shared buffers of the tests below."""
    g = torch.Generator().manual_seed(seed)
    w = {f"l{i}.w": torch.randn(50 + i, 7, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
         for i in range(12)}
    w["experts.0.down_proj.weight"] = torch.randn(9, 7, generator=g).t()  # non-contiguous
    w["embed.weight"] = torch.randn(1500, generator=g)  # 6000 B > 4096 B buffer
    return w


def _export_of(weights):
    names = list(weights)
    return lambda: iter([[(n, weights[n]) for n in names[:7]], [(n, weights[n]) for n in names[7:]]])


def test_flat_engines_get_reused_shared_buffers_and_read_before_they_are_refilled():
    """Engines with the flattened_bucket capability get one handle per (multi-dtype) buffer; the buffers are
    reused (double-buffered) across flushes and syncs, and a slow engine still reads what was packed for it
    (the sender refills a set only after every engine answered the post that read it)."""
    first, second = _mixed_weights(1), _mixed_weights(2)
    engines = [FakeEngine({k: torch.full(v.shape, float("nan"), dtype=v.dtype) for k, v in first.items()},
                          flat=True, delay=0.01) for _ in range(2)]
    ws = WeightSync("ipc", _export_of(first), [EngineEndpoint(e.url) for e in engines], rank=0, buffer_bytes=4096)
    ws.sync(version=1)
    for e in engines:
        assert all(torch.equal(e.weights[k], v) for k, v in first.items())
        assert set(e.formats) == {"flattened_bucket"} and len(e.formats) >= 3  # several flushes
    buffers_first = {p for e in engines for h in e.handles for p in h}
    n_first = len(engines[0].handles)
    ws.export = _export_of(second)
    metrics = ws.sync(version=2)
    for e in engines:
        assert all(torch.equal(e.weights[k], v) for k, v in second.items())
    # (the second sync may grow the other set once for the tensor larger than the capacity; after that, reuse)
    assert len({p for e in engines for h in e.handles[n_first:] for p in h} - buffers_first) <= 1
    seen, n_second = {p for e in engines for h in e.handles for p in h}, len(engines[0].handles)
    ws.sync(version=3)
    assert {p for e in engines for h in e.handles[n_second:] for p in h} <= seen  # reused, not new
    assert len(seen) <= 2 + 2  # two sets (+ their growth)
    assert metrics["weight_sync/checked_tensors"] == len(second)
    assert metrics["time/weight_sync_export"] >= 0 and metrics["time/weight_sync_wait"] >= 0
    ws.close()


def test_checksums_come_with_the_updates_when_the_engine_offers_them(trainer_weights):
    """An engine with update_checksums answers each update with the checksums of what it changed: no
    /get_weights_checksum round trip, and a broken load is still caught."""
    engine = FakeEngine({k: torch.full_like(v, float("nan")) for k, v in trainer_weights.items()}, flat=True,
                        update_sums=True)
    ws = _sync([engine], trainer_weights, [list(trainer_weights)])
    assert ws.sync(version=1)["weight_sync/checked_tensors"] == 3
    assert "/get_weights_checksum" not in engine.calls
    engine.corrupt = "c.weight"
    with pytest.raises(WeightSyncError, match=r"differs from the trainer in 1 tensors.*c\.weight"):
        ws.sync(version=2)


@pytest.mark.parametrize("synchronized", [True, False])
def test_engines_that_do_not_promise_to_have_read_get_reused_buffers_only_on_a_synchronized_device(synchronized,
                                                                                                  monkeypatch):
    """An engine that does not promise to have read the buffers when it replies (SGLang) gets the same
    flattened_bucket payloads; on a synchronized device (CPU: its copies are done when it replies) in the
    buffers reused across syncs, on a GPU/NPU (its copies may still be queued) in new buffers for every
    flush, never refilled."""
    monkeypatch.setattr(type(get_accelerator()), "is_synchronized_device", lambda self: synchronized)
    weights = _mixed_weights(3)
    nan = {k: torch.full(v.shape, float("nan"), dtype=v.dtype) for k, v in weights.items()}
    flat, plain = FakeEngine(nan, flat=True), FakeEngine(nan)
    ws = WeightSync("ipc", _export_of(weights), [EngineEndpoint(flat.url), EngineEndpoint(plain.url)], rank=0,
                    buffer_bytes=4096)
    for version in (1, 2):
        ws.sync(version=version)
    for e in (flat, plain):
        assert all(torch.equal(e.weights[k], v) for k, v in weights.items())
        assert set(e.formats) == {"flattened_bucket"} and len(e.formats) >= 6
    buffers = [p for h in plain.handles for p in h]
    if synchronized:
        assert ws.tensor_handles.sender is not None and len(set(buffers)) <= 4  # two sets (+ their growth), every sync
    else:
        assert ws.tensor_handles.sender is None and len(set(buffers)) == len(buffers)  # one new buffer per flush
    ws.close()


def test_refused_update_in_a_later_flush_stops_the_sync():
    weights = _mixed_weights(4)
    engine = FakeEngine(weights, flat=True)
    engine.refuse = True
    ws = WeightSync("ipc", _export_of(weights), [EngineEndpoint(engine.url)], rank=0, buffer_bytes=4096)
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        ws.sync(version=1)
    engine.refuse = False
    ws.sync(version=2)  # the sender recovers: its buffers are free again
    assert all(torch.equal(engine.weights[k], v) for k, v in weights.items())


def test_engine_without_checksum_endpoint_is_synced_unchecked(trainer_weights, caplog):
    """SGLang has no /get_weights_checksum: the sync goes through, the check is skipped with one line
    per engine (not per sync), and an engine that serves it is still checked."""
    sglang_like = FakeEngine({k: torch.full_like(v, float("nan")) for k, v in trainer_weights.items()}, checksums=False)
    checked = FakeEngine(trainer_weights)
    ws = _sync([sglang_like, checked], trainer_weights, [list(trainer_weights)])
    with caplog.at_level(logging.WARNING, logger="slime.backends.megatron.weight_sync"):
        assert ws.sync(version=1)["weight_sync/checked_tensors"] == 3
        ws.sync(version=2)
    skipped = [r.getMessage() for r in caplog.records if "check skipped" in r.getMessage()]
    assert len(skipped) == 1 and sglang_like.url in skipped[0] and "weights_checksum" in skipped[0]
    assert "/get_weights_checksum" not in sglang_like.calls and sglang_like.gets == ["/get_model_info"]
    assert checked.calls.count("/get_weights_checksum") == 2
    for k, v in trainer_weights.items():
        assert torch.equal(sglang_like.weights[k], v)
    alone = _sync([sglang_like], trainer_weights, [list(trainer_weights)])
    assert alone.sync(version=3)["weight_sync/checked_tensors"] == 0


def test_restarted_engine_on_a_new_port_is_synced(trainer_weights):
    """The manager's list, passed to every sync, replaces the old one: a restarted engine on a new port
    gets the weights; the old address is not called again."""
    nan = {k: torch.full_like(v, float("nan")) for k, v in trainer_weights.items()}
    first, restarted = FakeEngine(nan), FakeEngine(nan)
    ws = _sync([first], trainer_weights, [list(trainer_weights)])
    ws.sync(version=1)
    calls_before = len(first.calls)
    ws.sync(version=2, engines=[EngineEndpoint(restarted.url, instance=1)])
    assert len(first.calls) == calls_before and restarted.calls.count("/get_weights_checksum") == 1
    for k, v in trainer_weights.items():
        assert torch.equal(restarted.weights[k], v)
    assert not ws.set_engines([EngineEndpoint(restarted.url, instance=1)])  # unchanged list: nothing to do
    with pytest.raises(WeightSyncError, match="no running engine"):
        ws.set_engines([])


def test_distributed_group_is_formed_again_for_a_restarted_engine(trainer_weights, monkeypatch):
    """Same url, new process (instance 1): the old group is destroyed on the engines that had it and on
    the trainer, then formed again with the current engines."""
    import slime.utils.distributed as dist_utils

    a, b = FakeEngine(trainer_weights), FakeEngine(trainer_weights)
    ws = WeightSync("distributed", lambda: iter(()), [EngineEndpoint(a.url), EngineEndpoint(b.url)], rank=0)
    old_group, destroyed, formed = object(), [], []
    ws.group = old_group
    monkeypatch.setattr(dist_utils, "destroy_custom_process_group", destroyed.append)
    monkeypatch.setattr(ws, "connect", lambda: formed.append([(e.url, e.instance) for e in ws.engines]))
    assert not ws.set_engines([EngineEndpoint(a.url), EngineEndpoint(b.url)])
    assert destroyed == [] and formed == []
    assert ws.set_engines([EngineEndpoint(a.url), EngineEndpoint(b.url, instance=1)])
    assert destroyed == [old_group] and formed == [[(a.url, 0), (b.url, 1)]]
    assert a.calls == b.calls == ["/destroy_weights_update_group"]


def test_checksum_mismatch_stops(trainer_weights):
    engine = FakeEngine(trainer_weights)
    engine.corrupt = "b.bias"
    with pytest.raises(WeightSyncError, match=r"differs from the trainer in 1 tensors.*b\.bias"):
        _sync([engine], trainer_weights, [list(trainer_weights)]).sync(version=1)


def test_engine_refusal_is_an_error(trainer_weights):
    engine = FakeEngine(trainer_weights)
    engine.refuse = True
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        _sync([engine], trainer_weights, [list(trainer_weights)]).sync(version=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
@pytest.mark.parametrize("shape", [(7, 5), (251 * 3 + 2,), (300, 257), ()])
def test_checksum_detects_one_changed_element_and_moved_elements(dtype, shape):
    """Exact on the raw bytes: any single element changed to any other value (here: every bit flipped in
    turn for a random element), swapped neighbours and a transpose all change the checksum."""
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    x = (x > 0) if dtype == torch.bool else x.to(dtype)
    base = weight_checksum.named_checksums([("x", x)])
    assert weight_checksum.mismatches(base, weight_checksum.named_checksums([("x", x.clone())])) == []
    flat = x.reshape(-1)
    i = int(torch.randint(flat.numel(), (1,), generator=g))
    raw = flat.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)
    for bit in range(8 * x.element_size()):
        changed = raw.clone()
        changed[i * x.element_size() + bit // 8] ^= 1 << (bit % 8)
        assert weight_checksum.mismatches(base, {"x": weight_checksum.tensor_checksum(changed.view(dtype))}) == ["x"]
    if flat.numel() > 1:
        distinct = (flat[1:].view(torch.uint8).reshape(flat.numel() - 1, -1)
                    != flat[:-1].view(torch.uint8).reshape(flat.numel() - 1, -1)).any(1).nonzero()
        assert distinct.numel(), "random input must have two different neighbours"
        j = int(distinct[0])
        swapped = flat.clone()
        swapped[j], swapped[j + 1] = flat[j + 1], flat[j]
        assert weight_checksum.mismatches(base, {"x": weight_checksum.tensor_checksum(swapped.view(shape))}) == ["x"]
    if x.dim() == 2:
        assert weight_checksum.tensor_checksum(x.t().contiguous()) != base["x"]


def test_checksum_is_the_same_for_small_batched_and_large_tensors_and_for_slices():
    """Small tensors are summed together in one padded buffer, large ones in place; slices of a larger
    tensor at any byte offset; the figures must not depend on which path or neighbours a tensor has."""
    from slime.utils.weight_checksum import _SMALL_BYTES

    g = torch.Generator().manual_seed(3)
    big = torch.randn(_SMALL_BYTES // 4 + 37, generator=g)  # just over the small-tensor limit
    parts = [("a", big[:1000]), ("b", big[1:1001]), ("c", big[5:].view(torch.uint8)[3:-1]), ("big", big)]
    together = weight_checksum.named_checksums(parts)
    for name, t in parts:
        assert weight_checksum.named_checksums([(name, t.clone())]) == {name: together[name]}
    assert together["a"] != together["b"] and together["a"][0] == 4000
    assert weight_checksum.mismatches(together, {**together, "a": together["b"]}) == ["a"]
    assert weight_checksum.mismatches(together, {k: v for k, v in together.items() if k != "c"}) == ["c"]
    assert weight_checksum.mismatches({}, {"x": [1, 2, 3]}) == ["x"]


def test_resolve_mode(caplog):
    assert resolve_mode("auto", colocate=True, ipc_capable=True) == "ipc"
    assert resolve_mode("auto", colocate=False, ipc_capable=True) == "distributed"
    with caplog.at_level(logging.WARNING):
        assert resolve_mode("auto", colocate=True, ipc_capable=False) == "distributed"
    assert sum("falls back to the distributed path" in r.message for r in caplog.records) == 1
    with pytest.raises(WeightSyncError, match="cannot share tensors"):
        resolve_mode("ipc", colocate=True, ipc_capable=False)


@pytest.fixture
def _clean_megatron_state():
    from glm5_helpers import megatron_state_cleanup

    yield from megatron_state_cleanup()


@pytest.mark.parametrize("weight_sets", [False, True], ids=["shared-buckets", "weight-sets"])
def test_glm_export_is_synced_without_copies_of_its_own(tmp_path, _clean_megatron_state, weight_sets):
    """The GLM export (tp = ep = 1) hands out views of the parameters, transposed expert weights included;
    the shared-buffer sender copies them into a real embedded engine (flattened buckets, checksums
    returned with the updates), which ends up holding exactly the trainer's weights. With weight sets
    (the engine's offer) the export is copied straight into the engine's target set and committed."""
    from glm5_helpers import write_checkpoint
    from safetensors.torch import load_file

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.backends.megatron import export_hf, load_hf_model

    ckpt = write_checkpoint(tmp_path / "glm", "glm_moe_dsa", seed=2)
    original = load_file(f"{ckpt}/model.safetensors")
    model = load_hf_model(ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # the trainer has moved on from the checkpoint the engine loads
    params = {p.untyped_storage().data_ptr() for p in model.state_dict(keep_vars=True).values()
              if isinstance(p, torch.Tensor)}
    exported = {n: t for bucket in export_hf(model, 1 << 12) for n, t in bucket}
    assert exported.keys() == original.keys()
    assert all(t.untyped_storage().data_ptr() in params for t in exported.values())  # views, not copies
    assert any(not t.is_contiguous() for t in exported.values())  # expert weights: transposed views
    engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
    server = EngineHTTPServer(engine, "tok", 0)
    server.start_in_thread()
    try:
        ws = WeightSync("ipc", lambda: export_hf(model, 1 << 12), [EngineEndpoint(server.url, token="tok")], rank=0,
                        buffer_bytes=1 << 14)
        if not weight_sets:
            ws.takes_weight_sets = lambda engine: False
        paths = []
        post = ws.post
        ws.post = lambda e, path, *a, **k: (paths.append(path), post(e, path, *a, **k))[1]
        metrics = ws.sync(version=1)
        assert metrics["weight_sync/checked_tensors"] == len(original)
        assert "/get_weights_checksum" not in paths
        if weight_sets:
            assert paths.count("/commit_weight_sets") == 1 and "/update_weights_from_tensor" not in paths
        else:
            assert paths.count("/update_weights_from_tensor") > 1 and "/commit_weight_sets" not in paths
        for name, t in exported.items():
            assert torch.equal(engine.name_map.resolve(name), t), name
        assert not torch.equal(engine.name_map.resolve("model.norm.weight"), original["model.norm.weight"])
        ws.close()
    finally:
        server.stop()
        engine.shutdown()


def test_engine_keeps_the_last_received_buffers_open_and_drops_them_on_release():
    """Reused sender buffers are found again in torch's cache of opened shared storages only while the
    engine holds them: the last KEEP_OPEN buffers are held (least recently used dropped first)."""
    from slime.backends.embedded import flattened_bucket as fb

    fb.drop_open()
    flats = [(f"bucket{i}", torch.zeros(16 + 4 * i, dtype=torch.uint8)) for i in range(fb.KEEP_OPEN + 2)]
    for key, flat in flats:
        (name, view), = fb.unflatten(flat, [FlattenedTensorMetadata(key + ".w", torch.Size([2]), torch.float32, 8, 16, 8)])
        assert name == key + ".w" and view.data_ptr() == flat[8:].data_ptr()

    def again(key, flat):
        fb.unflatten(flat, [FlattenedTensorMetadata("x", torch.Size([1]), torch.float32, 0, 4, 4)])

    again(*flats[2])  # used again: now the most recent
    again("new", torch.zeros(4, dtype=torch.uint8))  # one more: the least recently used (bucket3) goes
    held = {t.data_ptr() for t in fb._open.values()}
    assert len(held) == fb.KEEP_OPEN and flats[2][1].data_ptr() in held
    assert not held & {flats[i][1].data_ptr() for i in (0, 1, 3)}
    fb.drop_open()
    assert not fb._open


@pytest.mark.timeout(600)
def test_distributed_sync_with_a_refusing_engine_aborts_resumes_every_engine_and_blocks_nothing():
    """Two engine processes join the weight-update group; one refuses the update without joining the
    broadcast. The sync fails with one error naming that engine (long before the 600 s timeout: the test's
    own limit would stop a hang), every engine is resumed, the other engine's update call returns, and
    the next sync forms the group again and goes through once the engine accepts."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    worker = os.path.join(root, "tests", "weight_sync_engine_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, mode], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for mode in ("receive", "refuse")]
    try:
        urls = [f"http://127.0.0.1:{int(p.stdout.readline())}" for p in procs]
        weights = {"a.weight": torch.randn(64, 32), "b.bias": torch.randn(7)}
        ws = WeightSync("distributed", lambda: iter([list(weights.items())]), [EngineEndpoint(u) for u in urls],
                        rank=0, check=False)
        ws.connect()
        with pytest.raises(WeightSyncError) as e:
            ws.sync(version=1)
        message = str(e.value)
        assert urls[1] in message and "refusing: weights are locked" in message and "aborted" in message
        assert "\n" not in message
        calls = [default_get(EngineEndpoint(u), "/calls")["calls"] for u in urls]
        for c in calls:  # paused, then resumed after the failure
            assert c[:2] == ["/init_weights_update_group", "/pause_generation"], c
            assert c[-1] == "/continue_generation" and "/flush_cache" in c, c
            assert "/destroy_weights_update_group" in c and "update_done" in c  # the receiver is not blocked
        assert ws.group is None
        procs[1].stdin.close()
        procs[1].wait(60)
        procs[1] = subprocess.Popen([sys.executable, worker, "receive"], env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        urls[1] = f"http://127.0.0.1:{int(procs[1].stdout.readline())}"
        ws.sync(version=2, engines=[EngineEndpoint(urls[0]), EngineEndpoint(urls[1], instance=1)])
        assert ws.group is not None
        for u in urls:
            assert default_get(EngineEndpoint(u), "/calls")["calls"][-1] == "/continue_generation"
        ws.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_mtp_layers_reach_only_engines_that_load_them(monkeypatch):
    """A checkpoint's MTP layers (model.layers.{N + k}.*) are not sent to engines without speculative decoding
    (the embedded engine rejects them as unknown; SGLang loads them only as its draft model)."""
    from types import SimpleNamespace

    import torch

    from slime.backends.megatron.weight_sync import engines_load_mtp, without_mtp_layers

    arch = SimpleNamespace(num_hidden_layers=3)
    t = torch.zeros(1)
    buckets = [[("model.embed_tokens.weight", t), ("model.layers.2.mlp.gate.weight", t)],
               [("model.layers.3.eh_proj.weight", t), ("model.layers.3.embed_tokens.weight", t)],
               [("model.layers.30.enorm.weight", t), ("lm_head.weight", t)]]
    kept = list(without_mtp_layers(iter(buckets), arch))
    assert [[n for n, _ in b] for b in kept] == [["model.embed_tokens.weight", "model.layers.2.mlp.gate.weight"],
                                                 ["lm_head.weight"]]
    assert not engines_load_mtp(SimpleNamespace(sglang_speculative_algorithm=None, rollout_engine="sglang"))
    assert not engines_load_mtp(SimpleNamespace(sglang_speculative_algorithm="EAGLE", rollout_engine="embedded"))
    monkeypatch.setattr("slime.backends.sglang.launcher.sglang_available", lambda: True)
    assert engines_load_mtp(SimpleNamespace(sglang_speculative_algorithm="EAGLE", rollout_engine="sglang"))


@pytest.mark.parametrize("ffn,hidden,capacity", [(24, 40, 1 << 20), (5, 7, 1 << 20), (24, 40, 5800)])
def test_exported_expert_views_pack_bit_exact_with_each_experts_gate_and_up_as_one_transpose(ffn, hidden, capacity,
                                                                                             monkeypatch):
    """The GLM export's expert weights (transposed views of megatron's [E, H, 2I] / [E, I, H]) land in the
    shared buffers bit-exact; an expert's gate and up are copied as the one [2I, H] transpose they form when
    their slots are adjacent (sizes that are whole 64-byte lines), each alone otherwise, and a buffer that
    fills between them splits the pair."""
    from slime.backends.megatron.weight_sync import shared_buckets as sb
    from slime_plugins.models.common.weights import EXPERT_W1, EXPERT_W2, WeightMap

    experts = 3
    g = torch.Generator().manual_seed(ffn)
    w1 = torch.randn(experts, hidden, 2 * ffn, generator=g).to(torch.bfloat16)
    w2 = torch.randn(experts, ffn, hidden, generator=g).to(torch.bfloat16)
    maps = [WeightMap("w1", (), EXPERT_W1, tuple(range(experts)), "e"), WeightMap("w2", (), EXPERT_W2, tuple(range(experts)), "e")]
    named = [(n, t) for m, w in zip(maps, (w1, w2)) for n, t in zip(m.hf_names_after_gather(experts), m.to_hf([w]))]
    assert all(not t.is_contiguous() for _, t in named)
    runs, original = [], sb._TransposedRun.copy
    monkeypatch.setattr(sb._TransposedRun, "copy", lambda self: (runs.append(self.count), original(self))[1])
    got = {}
    sender = sb.SharedBucketSender(capacity, torch.device("cpu"),
                                   lambda p: got.update({n: v.clone() for n, v in p.set.named_views()}))
    for n, t in named:
        sender.add(n, t)
    sender.finish()
    sender.close()
    assert set(got) == {n for n, _ in named}
    for n, t in named:
        assert torch.equal(got[n], t.contiguous()), n
    lined = ffn * hidden * 2 % 64 == 0
    if lined and capacity > 1 << 16:
        assert runs == [2] * experts + [1] * experts  # gate+up per expert, then each down
    elif not lined:
        assert runs == [1] * (3 * experts)
    else:  # 1920-byte weights, 5800-byte buffers: expert 1's up starts the second buffer
        assert runs == [2, 1, 1, 2, 1, 1, 1]
