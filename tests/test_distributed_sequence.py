"""Numbered distributed updates ("sequence", `"distributed_sequence": true`): the trainer posts bucket n + 1
once bucket n is received, before the engine has answered n; the engine receives the updates of a group in
their numbered order, each into the other of two buffers. No gloo here: the broadcasts are stand-ins."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from slime.backends.embedded.engine_weights import WeightControl, _ReceiveTurn
from slime.backends.embedded.errors import BadRequest


def _engine_side():
    host = SimpleNamespace(_cond=threading.Condition(), _groups={"g": object()})
    return host


def test_receive_turns_follow_the_numbers_not_the_arrival_order():
    host = _engine_side()
    order: list[int] = []

    def update(seq: int) -> None:
        turn = WeightControl._receive_turn(host, "g", seq)
        turn.wait()
        order.append(seq)  # the broadcast would run here
        turn.done()

    late = [threading.Thread(target=update, args=(s,)) for s in (2, 1)]
    for t in late:
        t.start()
    time.sleep(0.05)
    assert order == []  # 1 and 2 wait for 0
    update(0)
    for t in late:
        t.join(10)
    assert order == [0, 1, 2]
    with pytest.raises(BadRequest, match="arrived after"):  # a number already used
        WeightControl._receive_turn(host, "g", 1).wait()


def test_a_destroyed_group_ends_a_waiting_turn():
    host = _engine_side()
    turn = WeightControl._receive_turn(host, "g", 1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            turn.wait()
        except BadRequest as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    host.__dict__["_receive_order"].pop("g").close()  # what destroy_weights_update_group does
    t.join(10)
    assert not t.is_alive() and errors and "destroyed" in str(errors[0])


def test_a_turn_that_never_comes_times_out(monkeypatch):
    monkeypatch.setattr(_ReceiveTurn, "TIMEOUT_S", 0.05)
    with pytest.raises(BadRequest, match="never arrived"):
        WeightControl._receive_turn(_engine_side(), "g", 3).wait()


def test_two_receive_buffers_per_group():
    host = SimpleNamespace(device=torch.device("cpu"))
    specs = [("a", [4, 8], torch.float32)]
    bufs = [WeightControl._packed_receive(host, "g", specs, i)[0] for i in (0, 1, 0)]
    assert bufs[0].data_ptr() == bufs[2].data_ptr() != bufs[1].data_ptr()


def test_trainer_posts_the_next_numbered_bucket_before_the_previous_answer(monkeypatch):
    """Bucket 0's answer is held back until bucket 1 has been posted: the sync goes through only if the
    trainer sends bucket 1 while bucket 0 is still being applied; every bucket carries its number, counted on
    across syncs of the same group."""
    import slime.utils.distributed as dist_utils
    from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync

    class Done:
        def is_completed(self):
            return True

        def wait(self):
            return True

    monkeypatch.setattr(dist_utils, "broadcast_async", lambda t, src, group: Done())
    posted: list[int] = []
    second = threading.Event()

    def post(engine, path, payload, timeout=600.0):
        if path == "/update_weights_from_distributed":
            posted.append(payload["sequence"])
            if payload["sequence"] % 3 == 1:
                second.set()
            if payload["sequence"] % 3 == 0 and not second.wait(10):
                return {"success": False, "message": "bucket 1 never came while bucket 0 was applied"}
        return {"success": True}

    info = {"distributed_flattened_bucket": True, "distributed_sequence": True}
    buckets = [[(f"w{i}", torch.full((64, 64), float(i)).t())] for i in range(3)]
    ws = WeightSync("distributed", lambda: iter(buckets), [EngineEndpoint("http://127.0.0.1:9")], rank=0,
                    check=False, post=post, get=lambda e, p, timeout=60.0: info)
    ws.connect = lambda: setattr(ws, "group", object())  # no real group: a stand-in, numbered from 0
    ws.connect()
    ws.sync(1)
    assert posted == [0, 1, 2] and ws.broadcast.in_flight == []
    second.clear()
    ws.sync(2)
    assert posted == [0, 1, 2, 3, 4, 5]
