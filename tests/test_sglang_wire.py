"""The trainer's and the embedded engine's wire formats against SGLang's own classes (the pinned sglang,
installed without dependencies by the sglang-test extra; see tests/sglang_reference.py for what is loaded
and why SGLang's package cannot be imported on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import sglang_reference as ref
from json_http import JsonHandler, serve

pytestmark = pytest.mark.skipif(not ref.available(), reason="sglang (the sglang-test extra) is not installed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "sglang_wire_worker.py")


@pytest.fixture(autouse=True, scope="module")
def _sglang_modules_out_afterwards():
    yield
    ref.unload()


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def _weights(seed=0):
    """Four dtypes, in an order that keeps SGLang's unpadded packing aligned for each (its receiver checks)."""
    g = torch.Generator().manual_seed(seed)
    return [("c.w", torch.randn(3, 4, 2, generator=g).double()), ("a.weight", torch.randn(7, 6, generator=g)),
            ("b.bias", torch.randn(13, generator=g).bfloat16()), ("d.mask", torch.rand(9, generator=g) > 0.5)]


def test_trainer_payload_decodes_with_sglangs_classes():
    """What the trainer posts (SharedBucketSender's flattened payload) opens with SGLang's
    MultiprocessingSerializer (its SafeUnpickler) and rebuilds with its FlattenedTensorBucket, bit for bit."""
    from slime.accelerator import get_accelerator
    from slime.backends.megatron.weight_sync.shared_buckets import SharedBucketSender

    common, tb = ref.common(), ref.tensor_bucket()
    acc, posted = get_accelerator(), []
    sender = SharedBucketSender(1 << 16, acc.device(), lambda packed: posted.append(packed.flattened_payload(acc)),
                                reuse=False, share=acc.reduce_tensor)
    named = _weights()
    for n, t in named:
        sender.add(n, t)
    sender.finish()
    obj = common.MultiprocessingSerializer.deserialize(posted[0])
    assert set(obj) == {"flattened_tensor", "metadata"} and obj["flattened_tensor"].dtype == torch.uint8
    assert all(type(m) is tb.FlattenedTensorMetadata for m in obj["metadata"])
    out = dict(tb.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                        metadata=obj["metadata"]).reconstruct_tensors())
    assert list(out) == [n for n, _ in named]
    for n, t in named:
        assert out[n].dtype == t.dtype and torch.equal(out[n], t), n
    sender.close()


def test_sglang_built_payload_opens_in_the_embedded_engine():
    """A payload SGLang's classes build (as upstream slime's trainer builds it) passes the embedded engine's
    decoder (allow-list unpickler, checks) and gives the same tensors; a tampered range is refused."""
    import torch.multiprocessing as mp

    from slime.backends.embedded.errors import BadRequest
    from slime.backends.embedded.server import _decode_named_tensors

    common, tb = ref.common(), ref.tensor_bucket()
    mp.set_sharing_strategy("file_system")  # as on CPU here (fd passing needs the sender's authkey)
    named = _weights(1)
    bucket = tb.FlattenedTensorBucket(named_tensors=named)
    body = {"load_format": "flattened_bucket", "serialized_named_tensors": [common.MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)]}
    got = dict(_decode_named_tensors(body))
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    meta = bucket.get_metadata()
    meta[1].end_idx += 2
    body["serialized_named_tensors"] = [common.MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": meta}, output_str=True)]
    with pytest.raises(BadRequest, match=r"^flattened bucket refused: a\.weight: range"):
        _decode_named_tensors(body)


@pytest.mark.timeout(300)
def test_trainer_group_host_and_sglangs_group_init_meet_and_broadcast_a_bucket(tmp_path):
    """Two processes: the trainer hosts the weight-update group (GroupHost, rank 0) and an SGLang engine
    rank joins with SGLang's init_custom_process_group (tcp:// rendezvous, PrefixStore(group_name)), then
    receives a flattened bucket broadcast as SGLang's updater receives it."""
    from slime.backends.embedded.flattened_bucket import pack
    from slime.utils.distributed import GroupHost, broadcast, destroy_custom_process_group
    from slime.utils.net import free_port

    named = _weights(2)
    flat, meta = pack(named)
    # SGLang's receiver allocates the bucket from names/dtypes/shapes, packed without gaps: send it that way.
    packed = ref.tensor_bucket().FlattenedTensorBucket(named_tensors=named).get_flattened_tensor()
    out = str(tmp_path / "engine")
    with open(out + ".json", "w") as f:
        json.dump({"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                   "shapes": [list(t.shape) for _, t in named]}, f)
    port = free_port()
    host = GroupHost("127.0.0.1", port, 2, "slime_weight_sync", "gloo", timeout_s=120)
    engine = subprocess.Popen([sys.executable, WORKER, "sglang-engine", "127.0.0.1", str(port), "2", "1",
                               "slime_weight_sync", out], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        pg = host.join(refused=lambda: None if engine.poll() is None else RuntimeError("engine exited"))
        broadcast(packed, src=0, group=pg)
        assert engine.wait(120) == 0, engine.stdout.read()[-2000:]
    finally:
        if engine.poll() is None:
            engine.kill()
    got = torch.load(out + ".pt")
    for n, t in named:
        assert torch.equal(got[n], t), n
    assert flat.numel() >= packed.numel()  # (this project's own packing aligns slots; SGLang's receiver does not)
    destroy_custom_process_group(pg)
    host.close()


class _TP2Engine:
    """A TP-2 engine stand-in: engine rank j opens payload j with SGLang's classes and loads its shard
    (dim 0 halves, as a column-parallel layer loads its part of the full HF tensor)."""

    def __init__(self):
        self.received = []  # per update: per rank (shm segment name, {name: shard})
        outer = self
        common, tb = ref.common(), ref.tensor_bucket()

        class Handler(JsonHandler):
            def do_GET(self):
                self.reply(200, {"model_path": "/m"})

            def do_POST(self):
                body = self.body()
                if self.path == "/update_weights_from_tensor":
                    try:
                        outer.received.append(self._open(body))
                    except Exception as e:  # reported to the trainer (and so to the test) instead of a hang
                        return self.reply(200, {"success": False, "message": f"{type(e).__name__}: {e}"})
                self.reply(200, {"success": True, "message": ""})

            def _open(self, body):
                    assert body["load_format"] == "flattened_bucket"
                    ranks = []
                    for j, payload in enumerate(body["serialized_named_tensors"]):
                        obj = common.MultiprocessingSerializer.deserialize(payload)
                        flat = obj["flattened_tensor"]
                        segment = flat.untyped_storage()._share_filename_cpu_()[1].decode()
                        tensors = tb.FlattenedTensorBucket(flattened_tensor=flat, metadata=obj["metadata"])
                        ranks.append((segment, {n: t.chunk(2, dim=0)[j].clone() for n, t in tensors.reconstruct_tensors()}))
                    return ranks

        self.server, self.url = serve(Handler)


@pytest.mark.timeout(900)
def test_tp2_engine_gets_one_payload_per_rank_from_each_colocated_trainer_rank(tmp_path):
    """Two trainer ranks (gloo world) sync to one TP-2 engine colocated with them: the post carries two
    payloads, payload j in shared memory created by trainer rank j's process, and each engine rank's shard
    equals that shard of the trainer's weights."""
    from datetime import timedelta

    import torch.distributed as dist

    from slime.utils.net import free_port

    engine = _TP2Engine()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, "trainer-rank", str(r), "2", str(port), engine.url, "5"],
                              env=_env(), stdout=open(logs[r], "w"), stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        try:
            p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
    outs = [log.read_text() for log in logs]
    assert all(p.returncode == 0 for p in procs), [o[-3000:] for o in outs]
    pids = [int(o.split("pid ", 1)[1].split()[0]) for o in outs]
    assert len(engine.received) == 1
    (seg0, shard0), (seg1, shard1) = engine.received[0]
    assert f"_{pids[0]}_" in seg0 and f"_{pids[1]}_" in seg1  # each rank's own shared memory
    g = torch.Generator().manual_seed(5)
    full = {"w.weight": torch.randn(8, 6, generator=g), "b.bias": torch.randn(4, generator=g).bfloat16()}
    for j, shard in enumerate((shard0, shard1)):
        for n, t in full.items():
            assert torch.equal(shard[n], t.chunk(2, dim=0)[j]), (j, n)
    del store
