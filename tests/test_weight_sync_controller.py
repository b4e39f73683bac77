"""The weight-sync controller's all-or-nothing sequence over each transport: a failed pause sends nothing, a
failed export or another pipeline stage's failure still resumes every engine, and the sync raises one line."""

import threading

import pytest
import torch

import slime.utils.distributed as dist_utils
from slime.backends.megatron.weight_sync import EngineEndpoint, StageRole, WeightSync, WeightSyncError

UPDATES = {"/update_weights_from_tensor", "/update_weights_from_distributed", "/commit_weight_sets"}


class Engines:
    """Stand-in engines: every call is recorded per engine url; the paths in `refuse` answer success: false."""

    def __init__(self, refuse=()):
        self.refuse, self.calls, self.lock = set(refuse), {}, threading.Lock()

    def post(self, engine, path, payload, timeout=600.0):
        with self.lock:
            self.calls.setdefault(engine.url, []).append(path)
        if path in self.refuse:
            return {"success": False, "message": f"{path} refused by {engine.url}"}
        return {"success": True}

    def get(self, engine, path, timeout=60.0):
        return {}  # offers nothing beyond SGLang's endpoints


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        return True


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [[(f"l{b}.w{i}", torch.randn(3 + i, 5 + b, generator=g)) for i in range(3)] for b in range(3)]


def _controller(mode, engines, export, monkeypatch, **kwargs):
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    ws = WeightSync(mode, export, [EngineEndpoint(u) for u in urls], rank=0, check=False, post=engines.post,
                    get=engines.get, buffer_bytes=1 << 12, **kwargs)
    if mode == "distributed":  # no real group: a stand-in, and broadcasts that complete at once
        monkeypatch.setattr(dist_utils, "broadcast_async", lambda t, src, group: _Done())
        monkeypatch.setattr(dist_utils, "destroy_custom_process_group", lambda group: None)
        ws.connect = lambda: setattr(ws, "group", object())
    return ws, urls


def _counting(buckets, exported, fail_after=None):
    def export():
        for i, bucket in enumerate(buckets):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("export broke in bucket 1")
            exported.append(i)
            yield bucket
    return export


def _resumed(calls):
    return calls[-2:] == ["/flush_cache", "/continue_generation"]


@pytest.mark.parametrize("mode", ["ipc", "distributed"])
def test_a_failed_pause_sends_nothing_drains_the_export_and_resumes_every_engine(mode, monkeypatch):
    engines, exported = Engines(refuse={"/pause_generation"}), []
    buckets = _weights(1)
    ws, urls = _controller(mode, engines, _counting(buckets, exported), monkeypatch)
    with pytest.raises(WeightSyncError, match="pause_generation") as e:
        ws.sync(version=1)
    assert "\n" not in str(e.value)
    assert exported == [0, 1, 2]  # the export (collective on every rank) ran to its end
    sent = [p for u in urls for p in engines.calls.get(u, []) if p in UPDATES]
    assert sent == []
    for u in urls:
        assert _resumed(engines.calls[u]), engines.calls[u]
    engines.refuse.clear()  # the next sync goes through
    exported.clear()
    metrics = ws.sync(version=2)
    assert exported == [0, 1, 2]
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 4 for b in buckets for _, t in b)
    for u in urls:
        assert any(p in UPDATES for p in engines.calls[u]) and _resumed(engines.calls[u])
    ws.close()


@pytest.mark.parametrize("mode", ["ipc", "distributed"])
def test_an_export_failure_resumes_every_engine_and_raises_it(mode, monkeypatch):
    engines, exported = Engines(), []
    ws, urls = _controller(mode, engines, _counting(_weights(2), exported, fail_after=1), monkeypatch)
    with pytest.raises(RuntimeError, match="export broke in bucket 1"):
        ws.sync(version=1)
    assert exported == [0]
    for u in urls:
        assert engines.calls[u][0] == "/pause_generation" and _resumed(engines.calls[u]), engines.calls[u]
    assert ws.broadcast.in_flight == []  # nothing left on the wire
    ws.close()


@pytest.mark.parametrize("mode", ["ipc", "distributed"])
def test_another_stages_failure_fails_the_sync_after_every_engine_resumed(mode, monkeypatch):
    """Under pipeline parallel rank 0 gathers every stage's outcome: a failure reported by stage 1 fails the
    sync (its first line) though stage 0's own transport succeeded, with no verification after it."""
    engines = Engines()
    gathered = []

    def gather(part):
        gathered.append(part)
        return [part, (123, {"x": [1, 2, 3]}, {}, "stage 1: /update_weights_from_distributed refused")]

    role = StageRole(stage=0, stages=2, sender=True, gather=gather)
    ws, urls = _controller(mode, engines, lambda: iter(_weights(3)), monkeypatch, role=role)
    ws.check = True
    with pytest.raises(WeightSyncError, match="^stage 1: /update_weights_from_distributed refused$"):
        ws.sync(version=1)
    assert len(gathered) == 1 and gathered[0][3] is None  # this stage's own part succeeded
    for u in urls:
        assert any(p in UPDATES for p in engines.calls[u]) and _resumed(engines.calls[u]), engines.calls[u]
        assert "/get_weights_checksum" not in engines.calls[u]
    ws.close()
