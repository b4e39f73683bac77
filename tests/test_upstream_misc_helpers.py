"""Upstream's small plugin-facing helpers at its module paths: slime.utils.misc (should_run_periodic_action, group_by,
chunk_named_params_by_size, Box, exec_command, get_free_port, get_current_node_ip), slime.utils.types (ParamInfo,
MultimodalType(s)), slime.utils.async_utils (AsyncLoopThread, get_async_loop) and slime.utils.http_utils
(get_host_info, run_router, terminate_process). Pure ones equal upstream's on recorded cases
(tests/data/upstream_misc_helpers_cases.json, recorded by tests/data/record_upstream_misc_helpers_cases.py at the
commit it names); the rest are checked for upstream's behaviour directly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import socket
import subprocess
import time

import pytest
import torch

from slime.utils import async_utils, http_utils, misc, types

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_misc_helpers_cases.json")) as f:
    RECORD = json.load(f)
KEYS = {None: None, "mod3": lambda x: x % 3, "sign": lambda x: x > 0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
PARAMS = [("a", [4], "float32"), ("b", [2, 3], "bfloat16"), ("c", [64], "int8"), ("d", [1], "float32"),
          ("e", [10], "float32"), ("f", [3], "int8")]


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40 and len(RECORD["periodic"]) == 312


def test_periodic_actions_equal_upstream():
    got = [[r, i, e, n, misc.should_run_periodic_action(r, i, e, n)] for r, i, e, n, _ in RECORD["periodic"]]
    assert got == RECORD["periodic"]
    assert any(x[-1] for x in got) and not all(x[-1] for x in got)


def test_group_by_and_chunks_equal_upstream():
    for items, key, want in RECORD["group_by"]:
        assert json.loads(json.dumps(list(map(list, misc.group_by(items, KEYS[key]).items())))) == want
    for size, want in RECORD["chunks"]:
        named = [(n, torch.zeros(shape, dtype=DTYPES[d])) for n, shape, d in PARAMS]
        assert [[n for n, _ in bucket] for bucket in misc.chunk_named_params_by_size(named, size)] == want


def test_box_exec_and_types_equal_upstream(capfd):
    assert misc.Box([1, 2]).inner == RECORD["box"][0]
    with pytest.raises(AttributeError):
        misc.Box(1).inner = 2
    (cmd, out), (cmd2, none), (cmd3, error, code) = RECORD["exec"]
    assert misc.exec_command(cmd, capture_output=True) == out and misc.exec_command(cmd2) is none
    with pytest.raises(subprocess.CalledProcessError) as e:
        misc.exec_command(cmd3, capture_output=True)
    assert (type(e.value).__name__, e.value.returncode) == (error, code)
    assert "EXEC: echo hi" in capfd.readouterr().out
    mm = RECORD["multimodal"]
    assert [dataclasses.asdict(t) for t in types.MultimodalTypes.all()] == mm["all"]
    assert {n: (dataclasses.asdict(types.MultimodalTypes.get(n)) if types.MultimodalTypes.get(n) else None)
            for n in mm["get"]} == mm["get"]
    fields = [f.name for f in dataclasses.fields(types.ParamInfo)] + [types.ParamInfo.__dataclass_params__.frozen]
    assert fields == RECORD["param_info"]


def test_free_port_skips_a_taken_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        assert misc.get_free_port(taken) > taken
        assert misc.get_free_port(taken, consecutive=1) != taken


def test_async_loop_thread_is_the_rollout_loop():
    handle = async_utils.get_async_loop()
    assert handle is async_utils.get_async_loop() and handle.loop is async_utils.get_loop()

    async def where():
        return asyncio.get_running_loop()

    assert handle.run(where()) is handle.loop and async_utils.run(where()) is handle.loop
    own = async_utils.AsyncLoopThread()
    assert own.loop is not handle.loop and own.run(where()) is own.loop
    own.loop.call_soon_threadsafe(own.loop.stop)


def test_host_info(monkeypatch):
    monkeypatch.setenv("SLIME_HOST_IP", "10.1.2.3")
    assert http_utils.get_host_info() == (socket.gethostname(), "10.1.2.3")
    monkeypatch.delenv("SLIME_HOST_IP")
    monkeypatch.delenv("SLIME_PREFER_IPV6", raising=False)
    host, ip = http_utils.get_host_info()
    assert host == socket.gethostname() and ":" not in ip and (ip == "127.0.0.1" or not ip.startswith("127."))


def _sleep_ignoring_sigterm():
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_terminate_process_kills_what_ignores_sigterm():
    process = multiprocessing.get_context("fork").Process(target=_sleep_ignoring_sigterm, daemon=True)
    process.start()
    time.sleep(1.0)  # let it install its handler
    http_utils.terminate_process(process, timeout=0.5)
    assert not process.is_alive() and process.exitcode == -9
    http_utils.terminate_process(process)  # already gone: nothing to do


def test_run_router_answers_one_when_the_router_cannot_start():
    assert http_utils.run_router(object()) == 1
