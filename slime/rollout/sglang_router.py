"""The real sglang-router (PyPI `sglang-router`, a Rust binary that runs on CPU too) in front of the engines,
as upstream slime runs it: started here (`python -m sglang_router.launch_router`'s command line, through
slime.rollout.sglang_router_main, which skips that launcher's import of sglang) unless
--sglang-router-ip/--sglang-router-port name one already running; every engine is registered as a worker
(`POST /workers`, removed again when a restarted engine moved). Generation then goes to the router's
`/generate` (SGLang's protocol; the router parses the request, fills in SGLang's defaults and takes one
`sampling_params` object per request, so callers send a sample per request).
Without the package the rollout manager routes in-process (slime.rollout.router) and logs that once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from slime.utils.http_client import HttpClient

logger = logging.getLogger(__name__)


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


class RouterError(RuntimeError):
    pass


@dataclass
class SGLangRouter:
    url: str  # http://host:port
    process: object | None = None  # ServerProcess when started here
    workers: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, worker_urls: list[str], host: str, log_path: str, timeout_s: float = 300.0,
              api_key: str | None = None, policy: str = "round_robin",
              extra_args: list[str] | tuple[str, ...] = ()) -> "SGLangRouter":
        """Launch the router on a free port with every worker; returns once it forwards to all of them."""
        from slime.backends.sglang.process import ServerProcess
        from slime.utils.net import free_port

        port = free_port()
        # the package's launcher's command line, through slime.rollout.sglang_router_main (the same Rust router,
        # without the import of sglang that sglang_router.launch_router makes for its Python balancer)
        cmd = [sys.executable, "-m", "slime.rollout.sglang_router_main", "--host", host, "--port", str(port),
               "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
               # default 30 s between start-up checks of the workers: the engines are already healthy
               "--worker-startup-check-interval", "1",
               # its metrics exporter binds a fixed port (29000) by default: a second router on the node
               # (another run, or one still shutting down) would panic on start
               "--prometheus-host", host, "--prometheus-port", str(free_port())] + (["--api-key", api_key] if api_key else [])
        cmd += list(extra_args)  # the --router-* options (slime.config.sglang_options.router_option_tokens): last wins
        proc = ServerProcess(name="sglang-router", cmd=cmd, env=dict(os.environ), log_path=log_path,
                             url=f"http://{host}:{port}")
        proc.start()
        router = cls(url=proc.url, process=proc, workers=list(worker_urls))
        try:
            router.wait_ready(timeout_s)
        except BaseException:
            proc.stop()
            raise
        return router

    @classmethod
    def external(cls, ip: str, port: int, worker_urls: list[str], timeout_s: float = 300.0) -> "SGLangRouter":
        """A router started by the user (--sglang-router-ip/--sglang-router-port): register the workers."""
        router = cls(url=f"http://{ip}:{int(port)}")
        for u in worker_urls:
            router.add_worker(u)
        router.wait_ready(timeout_s)
        return router

    @property
    def http(self) -> HttpClient:
        client = self.__dict__.get("_http")
        if client is None:
            client = self.__dict__["_http"] = HttpClient(self.url)
        return client

    def _call(self, method: str, path: str, timeout: float = 30.0, body: Any = None) -> tuple[int, bytes]:
        """(status, body) whatever the status; EngineUnreachable (a ConnectionError) when it does not answer."""
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        return self.http.send(method, path, data, {"Content-Type": "application/json"} if body is not None else None,
                              timeout)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router answers /get_model_info through a worker (it registers workers asynchronously)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and not self.process.running():
                raise RouterError(f"sglang-router exited: {self.process.describe_exit()}")
            try:
                status, body = self._call("GET", "/get_model_info", timeout=10)
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            except OSError as e:  # EngineUnreachable: not listening yet
                last = str(e)
            # short: the router is up ~0.2 s after its start (the engines are healthy by then); a 0.5 s step
            # made every run wait ~1 s here
            time.sleep(0.1)
        raise RouterError(f"sglang-router at {self.url} does not reach its workers after {timeout_s:.0f} s ({last})")

    def add_worker(self, url: str) -> None:
        """Register a worker: sglang-router >= 0.3 takes `POST /workers {"url"}`; older ones `/add_worker?url=`."""
        status, body = self._call("POST", "/workers", body={"url": url})
        if status in (404, 405):
            status, body = self._call("POST", "/add_worker?url=" + quote(url, safe=""))
        if status >= 300:
            raise RouterError(f"sglang-router {self.url} refused worker {url}: HTTP {status}: {body[:200]!r}")
        if url not in self.workers:
            self.workers.append(url)

    def wait_worker(self, url: str, timeout_s: float) -> None:
        """Until the router lists `url` as a healthy worker (it registers and health-checks added workers
        asynchronously: a request sent before that finds no worker). Routers without `GET /workers`: wait_ready."""

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = self._call("GET", "/workers", timeout=10)
            if status in (404, 405):
                return self.wait_ready(max(1.0, deadline - time.monotonic()))
            if status == 200 and any(w.get("url") == url and w.get("is_healthy", True)
                                     for w in json.loads(body).get("workers", [])):
                return
            time.sleep(0.2)
        raise RouterError(f"sglang-router at {self.url} did not take worker {url} within {timeout_s:.0f} s")

    def remove_worker(self, url: str) -> None:

        status, body = self._call("GET", "/workers")
        ids = [w.get("id") for w in (json.loads(body).get("workers", []) if status == 200 else []) if w.get("url") == url]
        for wid in ids:
            self._call("DELETE", f"/workers/{wid}")
        if status != 200:
            self._call("POST", "/remove_worker?url=" + quote(url, safe=""))
        if url in self.workers:
            self.workers.remove(url)

    def replace_worker(self, old: str, new: str) -> None:
        if old != new:
            self.remove_worker(old)
            self.add_worker(new)

    def stop(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.stop()
