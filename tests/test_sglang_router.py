"""The real sglang-router (PyPI sglang-router) in front of SGLang-protocol workers, and the in-process fallback."""

from __future__ import annotations

import logging
import types

import pytest

from json_http import JsonHandler, serve
from slime.rollout.sglang_router import SGLangRouter, router_available
from slime.utils.http_client import EngineClient


class _Worker:
    """Answers what the router probes (/health, /get_model_info, ...) and /generate with its own name."""

    def __init__(self, name: str):
        self.name, self.generated = name, []
        outer = self

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path in ("/health", "/health_generate"):
                    return self.reply(200, {"status": "ok"})
                if self.path in ("/get_model_info", "/model_info", "/server_info", "/get_server_info"):
                    return self.reply(200, {"model_path": "tiny", "is_generation": True})
                self.reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = self.body()
                if self.path != "/generate":
                    return self.reply(404, {"detail": "Not Found"})
                outer.generated.append(body)
                self.reply(200, {"text": outer.name, "output_ids": body["input_ids"][-1:],
                                  "meta_info": {"id": "r", "finish_reason": {"type": "length"},
                                                "output_token_logprobs": [[-0.5, body["input_ids"][-1], None]]}})

        self.server, self.url = serve(Handler)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.skipif(not router_available(), reason="sglang-router is not installed")
@pytest.mark.timeout(600)
def test_generation_goes_through_the_real_router_to_every_worker(tmp_path):
    """The router forwards SGLang's /generate request (with its own defaults filled in), spreads requests over the workers,
    and takes a worker moved to a new address (an engine restarted on another port)."""
    a, b, moved = _Worker("a"), _Worker("b"), _Worker("moved")
    router = SGLangRouter.start([a.url, b.url], "127.0.0.1", str(tmp_path / "router.log"), timeout_s=300)
    try:
        client = EngineClient(router.url, "token")
        outs = [client.generate([1, 2, 3 + i], {"max_new_tokens": 1, "temperature": 0}, return_logprob=True)
                for i in range(6)]
        assert [o["output_ids"] for o in outs] == [[3 + i] for i in range(6)]
        assert {o["text"] for o in outs} == {"a", "b"}  # both workers served (round robin)
        assert all(w.generated and w.generated[0]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0}
                   for w in (a, b))
        router.replace_worker(b.url, moved.url)
        router.wait_ready(120)
        texts = set()
        for i in range(8):  # the router registers a worker asynchronously: ask until the new one answered
            texts.add(client.generate([4, i], {"max_new_tokens": 1}, return_logprob=True)["text"])
            if "moved" in texts:
                break
        assert "moved" in texts
        served_b = len(b.generated)
        for i in range(4):
            assert client.generate([5, i], {"max_new_tokens": 1}, return_logprob=True)["text"] in ("a", "moved")
        assert len(b.generated) == served_b  # removed: no longer routed to
    finally:
        router.stop()
        for w in (a, b, moved):
            w.stop()


def _manager_stub(**args):
    return types.SimpleNamespace(args=types.SimpleNamespace(rollout_engine_startup_timeout=60, **args),
                                 urls=["http://127.0.0.1:1"], log_dir="/tmp", kind="embedded", _token="t", n=1)


def test_without_the_router_package_requests_are_routed_in_process(monkeypatch, caplog):
    from slime.ray.engine_fleet import RolloutEngines
    from slime.ray.rollout_manager import RolloutError
    from slime.rollout import sglang_router

    monkeypatch.setattr(sglang_router, "router_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="slime.ray.engine_fleet"):
        assert RolloutEngines._start_router(_manager_stub(rollout_router="auto")) is None
    assert any("routed in-process (the sglang-router package is not installed)" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(RolloutError, match="sglang-router package is not installed"):
        RolloutEngines._start_router(_manager_stub(rollout_router="sglang-router"))
    assert RolloutEngines._start_router(_manager_stub(rollout_router="in-process")) is None
