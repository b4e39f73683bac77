"""The address upstream's plugins send requests to (`args.sglang_router_ip/port`), in front of the engine fleet.

Upstream's streaming loop and custom generate functions post every request to one URL. Pointed at one engine
(the in-process routing's old choice) all plugin traffic went to engine 0, and a request lost to a dead engine
was retried against the same dead URL, so the engine was never restarted from this path. This server takes
those requests and sends each the way the built-in loop (slime.rollout.generate) sends its own:

- to the engine the fleet picks (`acquire`: least requests in flight among the usable engines), or, with
  sglang-router in front of the engines, to the router (`generation_client`), which stays the single target;
- a request that gets no answer (engine process dead), or a router 5xx (its worker died), is counted as
  re-issued and reported to the fleet (`generate.lose_request`, the built-in sender's own path: restart,
  re-sync of the run's weights, or RolloutError when no engine is left) and sent again to a live engine, at
  most MAX_FAILED_ATTEMPTS times; the count goes to `counters` (the rollout's, rollout/reissued_requests);
- any other reply, error statuses included, goes back to the plugin as the engine gave it (bytes and status).

`GET /list_workers` answers `{"urls": [...]}` of the serving engines (sglang-router's endpoint, which
upstream's abort reads). Callers' Authorization headers are passed on unchanged; the proxy adds none.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from slime.rollout.errors import RolloutError
from slime.rollout.generate import MAX_FAILED_ATTEMPTS, EngineFleet, RolloutCounters, lose_request
from slime.rollout.router import NoEngineAvailable
from slime.utils.http_client import EngineUnreachable, HttpClient

logger = logging.getLogger(__name__)

_PASSED_HEADERS = ("Authorization", "Content-Type")


class FleetProxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # a streaming rollout opens one connection per sample in flight

    def __init__(self, fleet: EngineFleet, host: str, timeout: float, serving_urls: Any) -> None:
        """timeout: one forwarded request's limit (--rollout-request-timeout); serving_urls: a callable giving
        the serving engines' URLs (for /list_workers)."""
        self.fleet, self.timeout, self.serving_urls = fleet, float(timeout), serving_urls
        self.fatal: RolloutError | None = None  # set once the fleet gave up: every later request fails at once
        self._clients: dict[str, HttpClient] = {}
        self._lock = threading.Lock()
        self.forwarded = 0  # requests answered by an engine (tests, logs)
        self.counters = RolloutCounters()  # the rollout in progress's (set by the fleet for each plugin rollout)
        super().__init__((host, 0), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="fleet-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def _client(self, url: str) -> HttpClient:
        with self._lock:  # one client per target: its connections are kept per thread
            if url not in self._clients:
                self._clients[url] = HttpClient(url)
            return self._clients[url]

    def forward(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        """One plugin request, sent until an engine answers it: (status, reply bytes)."""
        fleet, error = self.fleet, None
        for _ in range(MAX_FAILED_ATTEMPTS):
            if self.fatal is not None:
                return 503, _error_body(str(self.fatal))
            fleet.wait_unpaused()
            try:
                idx = fleet.acquire()
            except NoEngineAvailable as e:
                return 503, _error_body(str(e))
            gen = fleet.generation(idx)
            try:
                status, raw = self._client(fleet.generation_client(idx).url).send(method, path, body, headers,
                                                                                   self.timeout)
            except EngineUnreachable as e:
                error = e
            except BaseException:
                fleet.release(idx, served=False)
                raise
            else:
                if not (status >= 500 and fleet.behind_router()):
                    fleet.release(idx, served=status < 400)
                    self.forwarded += 1
                    return status, raw
                error = RuntimeError(f"sglang-router answered {status}: {raw[:200].decode(errors='replace')}")
            try:
                # counted, then the engine restarted (and re-synced) before we go on
                lose_request(fleet, idx, gen, error, self.counters, 1)
            except RolloutError as e:
                self.fatal = e
                logger.error("plugin requests: %s", e)
                return 503, _error_body(str(e))
        return 503, _error_body(f"{path}: no engine answered after {MAX_FAILED_ATTEMPTS} tries; last error: {error}")


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


class _Handler(BaseHTTPRequestHandler):
    server: FleetProxy
    protocol_version = "HTTP/1.1"  # plugins' clients keep their connections (slime.utils.http_client)
    disable_nagle_algorithm = True  # as the engine server: headers and body are two writes

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), fmt % args)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/list_workers":
            self._reply(200, json.dumps({"urls": list(self.server.serving_urls())}).encode())
            return
        self._forward(None)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self._forward(self.rfile.read(n) if n > 0 else b"")

    def _forward(self, body: bytes | None) -> None:
        headers = {k: self.headers[k] for k in _PASSED_HEADERS if self.headers.get(k)}
        try:
            status, raw = self.server.forward(self.command, self.path, body, headers)
        except Exception as e:  # noqa: BLE001 - one reply naming it; the proxy keeps serving
            logger.exception("plugin request %s %s failed in the proxy", self.command, self.path)
            status, raw = 500, _error_body(f"{type(e).__name__}: {e}")
        self._reply(status, raw)

    def _reply(self, status: int, raw: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the plugin gave up on it
