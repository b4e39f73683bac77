"""Weight sync client against a stand-in engine that speaks the SGLang endpoints it uses."""

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from slime.accelerator import get_accelerator
from slime.accelerator.ipc import deserialize_named_tensors
from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync, WeightSyncError, resolve_mode
from slime.utils import weight_checksum


class FakeEngine:
    """Holds named weights; applies /update_weights_from_tensor; reports checksums; logs calls."""

    def __init__(self, weights, checksums=True):
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.checksums = checksums  # False: an engine without slime's /get_weights_checksum (SGLang)
        self.calls = []
        self.gets = []
        self.corrupt = None  # name to perturb after updates (simulates a broken load)
        self.refuse = False
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, out):
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                engine.gets.append(self.path)
                if self.path == "/get_model_info":
                    info = {"model_path": "/m", "weight_version": "default"}
                    self._reply(200, {**info, "weights_checksum": True} if engine.checksums else info)
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                engine.calls.append(self.path)
                if self.path == "/get_weights_checksum" and not engine.checksums:
                    return self._reply(404, {"detail": "Not Found"})
                out = engine.handle(self.path, body)
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def handle(self, path, body):
        if path == "/update_weights_from_tensor":
            if self.refuse:
                return {"success": False, "message": "shape mismatch for x"}
            acc = get_accelerator()
            named = deserialize_named_tensors(base64.b64decode(body["serialized_named_tensors"][0]),
                                              acc.ipc_rebuild_allowlist())
            for name, t in named:
                self.weights[name].copy_(t)
            if self.corrupt:
                self.weights[self.corrupt].view(-1)[0] += 1e-3
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


def _sync(engines, weights, bucket_names):
    def export():
        for names in bucket_names:
            yield [(n, weights[n]) for n in names]
    return WeightSync("ipc", export, [EngineEndpoint(e.url) for e in engines], rank=0)


def test_ipc_sync_updates_engine_and_verifies(trainer_weights):
    engines = [FakeEngine({k: torch.full_like(v, float("nan")) for k, v in trainer_weights.items()}) for _ in range(2)]
    ws = _sync(engines, trainer_weights, [["a.weight", "b.bias"], ["c.weight"]])
    metrics = ws.sync(version=1)
    for e in engines:
        for k, v in trainer_weights.items():
            assert torch.equal(e.weights[k], v)
        assert e.calls[:2] == ["/pause_generation", "/flush_cache"]
        assert e.calls.count("/update_weights_from_tensor") == 2  # one per bucket
        assert e.calls[-3:] == ["/flush_cache", "/continue_generation", "/get_weights_checksum"]
    assert metrics["weight_sync/checked_tensors"] == 3
    assert metrics["weight_sync/bytes"] == sum(v.numel() * 4 for v in trainer_weights.values())


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
