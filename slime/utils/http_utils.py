"""Async HTTP for plugins, upstream slime's `slime.utils.http_utils` contract:

    out = await post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", payload)
    info = await get(url)

`post` retries any failure (connection, HTTP error status) once a second, `max_retries` attempts in all,
then raises the last error; the answer is the decoded JSON (or the text when it is not JSON). Requests
go over this project's engine transport (slime.utils.http_client) in worker threads, at most
`init_http_client(args)`'s concurrency at once (--sglang-server-concurrency x engines, within
--max-concurrency).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from slime.rollout.settings import fleet_request_limit
from slime.utils.http_client import EngineClient, EngineError

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 512
RETRY_INTERVAL_S = 1.0
_state = {"concurrency": DEFAULT_CONCURRENCY, "token": None}
_limits: dict[int, asyncio.Semaphore] = {}  # one per event loop (a semaphore belongs to its loop)
_lock = threading.Lock()


def init_http_client(args: Any) -> None:
    """Size the client for the run: --sglang-server-concurrency requests per engine."""
    with _lock:
        _state["concurrency"] = request_limit(args)
        _limits.clear()


def request_limit(args: Any) -> int:
    """Requests in flight at once: --sglang-server-concurrency (512 unset) x engines (at least one), within
    --max-concurrency, the same limit as the built-in loop's (slime.rollout.settings.fleet_request_limit)."""
    per_engine = int(getattr(args, "sglang_server_concurrency", None) or DEFAULT_CONCURRENCY)
    return fleet_request_limit(per_engine, get_rollout_num_engines(args), getattr(args, "max_concurrency", None))


def get_rollout_num_engines(args: Any) -> int:
    if getattr(args, "rollout_num_engines", None) is not None:
        return int(args.rollout_num_engines)
    gpus = int(getattr(args, "rollout_num_gpus", None) or 0)
    per_engine = int(getattr(args, "rollout_num_gpus_per_engine", None) or 1)
    return max(1, gpus // per_engine) if gpus > 0 else 0


def _limit() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    with _lock:
        sem = _limits.get(id(loop))
        if sem is None:
            sem = _limits[id(loop)] = asyncio.Semaphore(_state["concurrency"])
        return sem


def _client_for(url: str, headers: dict | None) -> tuple[EngineClient, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"url must look like http://host:port/path, got {url!r}")
    token = None
    auth = (headers or {}).get("Authorization", "")
    if auth.startswith("Bearer "):
        token = auth[len("Bearer "):]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return EngineClient(f"http://{parts.hostname}:{parts.port}", token), path


async def _request(method: str, url: str, payload: Any, headers: dict | None) -> Any:
    client, path = _client_for(url, headers)
    async with _limit():
        return await asyncio.to_thread(client.request, method, path, payload)


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST JSON `payload` (None sends {}); retried once a second on any error, `max_retries` attempts."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return await _request("POST", url, payload if payload is not None else {}, headers)
        except (EngineError, OSError) as e:
            if attempt >= max(1, int(max_retries)):
                logger.info("POST %s failed %d times, giving up: %s", url, attempt, e)
                raise
            logger.info("POST %s failed (attempt %d/%d), retrying: %s", url, attempt, max_retries, e)
            await asyncio.sleep(RETRY_INTERVAL_S)


async def get(url: str, headers: dict | None = None) -> Any:
    """GET, decoded JSON; no retries (upstream's contract)."""
    return await _request("GET", url, None, headers)


def is_port_available(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def find_available_port(base_port: int) -> int:
    port = base_port
    while not is_port_available(port):
        port += 1
    return port
