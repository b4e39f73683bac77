"""Upstream's plugin path (the streaming loop, slime.rollout.sglang_rollout) over the engine fleet: its requests,
sent to `args.sglang_router_ip/port`, reach both of two embedded engines, and a request lost to an engine killed
mid-rollout is reported to the fleet, which restarts the engine; the rollout comes back with every sample."""

from __future__ import annotations


import pytest

from rollout_manager_helpers import engine_clients, kill_engine_1_mid_rollout, two_engine_manager

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    with two_engine_manager(tmp_path_factory.mktemp("plugin-fleet"), 3, rollout_batch_size=4,
                            rollout_function_path="slime.rollout.sglang_rollout.generate_rollout") as m:
        yield m


def _generated_tokens(clients):
    return [c.get("/health")["stats"]["generated_tokens"] for c in clients]


def _check_every_sample(result, args):
    from slime.rollout.sample import SampleStatus

    samples = result["samples"]
    n = args.rollout_batch_size * args.n_samples_per_prompt
    assert len(samples) == n and len({s.index for s in samples}) == n  # each exactly once
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert 1 <= s.response_length == len(s.rollout_log_probs) < len(s.tokens)
        assert s.reward is not None


def test_plugin_requests_reach_both_engines(manager):
    handle, args = manager
    clients = engine_clients(handle)
    before = _generated_tokens(clients)
    result = ray.get(handle.generate.remote(0, with_samples=True), timeout=180)
    _check_every_sample(result, args)
    after = _generated_tokens(clients)
    served = [a - b for a, b in zip(after, before)]
    assert all(x > 0 for x in served), f"tokens generated per engine: {served}"
    assert sum(served) == sum(s.response_length for s in result["samples"])
    assert result["metrics"]["rollout/engine_restarts"] == 0 and result["metrics"]["rollout/reissued_requests"] == 0


def test_engine_death_on_the_plugin_path_is_recovered(manager):
    handle, args = manager
    future, pid_before, actors = kill_engine_1_mid_rollout(handle, 1)
    result = ray.get(future, timeout=180)
    _check_every_sample(result, args)
    failures = ray.get(handle.failures.remote())
    assert len(failures) == 1 and failures[0]["engine"] == 1 and failures[0]["exit_code"] == -9
    status = ray.get(actors[1].status.remote())
    assert status["running"] and status["starts"] == 2 and status["pid"] != pid_before
    # the lost requests the proxy re-sent, in the rollout's metrics as the built-in path reports its own
    assert result["metrics"]["rollout/engine_restarts"] == 1 and result["metrics"]["rollout/reissued_requests"] >= 1
    assert [e["instance"] for e in ray.get(handle.engines.remote())] == [0, 1]
    # the restarted engine takes plugin requests again
    clients = engine_clients(handle)
    before = _generated_tokens(clients)
    result = ray.get(handle.generate.remote(2, with_samples=True), timeout=180)
    _check_every_sample(result, args)
    assert all(a > b for a, b in zip(_generated_tokens(clients), before))


class _FakeFleet:
    """Two engines: index 0 at a closed port (dead), 1 a live stand-in; the fleet's answers recorded."""

    def __init__(self, live_url, dead_url, give_up=False):
        from types import SimpleNamespace

        self.targets = [SimpleNamespace(url=dead_url), SimpleNamespace(url=live_url)]
        self.usable, self.reports, self.released, self.give_up = [True, True], [], [], give_up

    def acquire(self):
        return 0 if self.usable[0] else 1

    def release(self, idx, served):
        self.released.append((idx, served))

    def generation(self, idx):
        return 7

    def generation_client(self, idx):
        return self.targets[idx]

    def report_failure(self, idx, generation, error):
        from slime.rollout.errors import RolloutError

        self.reports.append((idx, generation, type(error).__name__))
        if self.give_up:
            raise RolloutError("rollout engine 0 died and its 1 restarts are used up; no engine left")
        self.usable[idx] = False

    def wait_unpaused(self):
        return None

    def behind_router(self):
        return False


@pytest.fixture
def live_engine():
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Echo(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = 400 if body.get("bad") else 200
            reply = json.dumps({"echo": body, "auth": self.headers.get("Authorization")}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port nothing listens on: the dead engine
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    yield f"http://127.0.0.1:{server.server_address[1]}", dead
    server.shutdown()
    server.server_close()


def test_proxy_resends_a_lost_request_and_passes_replies_through(live_engine):
    from slime.rollout.fleet_proxy import FleetProxy
    from slime.utils.http_client import EngineError, HttpClient

    fleet = _FakeFleet(*live_engine)
    proxy = FleetProxy(fleet, "127.0.0.1", 10.0, lambda: [live_engine[0]])
    try:
        client = HttpClient(proxy.url, token="secret")
        out = client.post("/generate", {"input_ids": [1, 2, 3]})
        assert out == {"echo": {"input_ids": [1, 2, 3]}, "auth": "Bearer secret"}  # the caller's header, passed on
        assert fleet.reports == [(0, 7, "EngineUnreachable")] and fleet.released == [(0, False), (1, True)]
        assert proxy.counters.reissued == 1 and proxy.forwarded == 1  # counted as the built-in sender counts
        with pytest.raises(EngineError) as e:  # an engine's error reply reaches the caller as it is, not re-sent
            client.post("/generate", {"bad": True})
        assert e.value.status == 400 and len(fleet.reports) == 1
        assert client.get("/list_workers") == {"urls": [live_engine[0]]}
    finally:
        proxy.stop()


def test_proxy_fails_every_request_once_the_fleet_gives_up(live_engine):
    from slime.rollout.fleet_proxy import FleetProxy
    from slime.utils.http_client import EngineError, HttpClient

    fleet = _FakeFleet(*live_engine, give_up=True)
    proxy = FleetProxy(fleet, "127.0.0.1", 10.0, lambda: [])
    try:
        client = HttpClient(proxy.url)
        for _ in range(2):
            with pytest.raises(EngineError) as e:
                client.post("/generate", {"input_ids": [1]})
            assert e.value.status == 503 and "no engine left" in e.value.message
        assert len(fleet.reports) == 1 and "no engine left" in str(proxy.fatal)  # the second one not sent at all
    finally:
        proxy.stop()
