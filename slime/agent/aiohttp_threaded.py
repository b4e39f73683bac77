"""An aiohttp application served from a daemon thread with its own event loop (upstream slime's
`slime.agent.aiohttp_threaded` contract), so a rollout's adapter answers while the rollout's loop waits."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """Logs only failed or slow requests (an agent run makes thousands of ordinary ones)."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request, response, time):
        if request.method == "HEAD" or (response.status == 200 and time <= self.SLOW_THRESHOLD_SEC):
            return
        super().log(request, response, time)


@dataclass
class AppHandle:
    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def run_app_in_thread(app: web.Application, *, host: str = "0.0.0.0", port: int = 0,
                      thread_name: str = "aiohttp-app", start_timeout_sec: float = 15.0,
                      runner_kwargs: dict[str, Any] | None = None) -> AppHandle:
    """Serves `app` on host:port (0: a free port) and returns once it listens; `runner_kwargs` go to
    web.AppRunner (e.g. handler_cancellation=True: a client that disconnects cancels its handler)."""
    ready = threading.Event()
    result: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            sockets = site._server.sockets if site._server is not None else []  # aiohttp keeps no public handle
            result.update(loop=loop, runner=runner, port=sockets[0].getsockname()[1] if sockets else port)
        except BaseException as e:
            result["error"] = e
            ready.set()
            raise
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not ready.wait(timeout=start_timeout_sec):
        raise TimeoutError(f"{thread_name}: not listening on {host}:{port} after {start_timeout_sec} s")
    if "error" in result:
        raise result["error"]
    return AppHandle(host=host, port=int(result["port"]), thread=thread, loop=result["loop"], runner=result["runner"])
