"""Async HTTP for plugins, upstream slime's `slime.utils.http_utils` contract:

    out = await post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", payload)
    info = await get(url)

`post` retries any failure (connection, HTTP error status) once a second, `max_retries` attempts in all,
then raises the last error; the answer is the decoded JSON (or the text when it is not JSON). Requests
go over this project's engine transport (slime.utils.http_client) in worker threads, at most
`init_http_client(args)`'s concurrency at once (--sglang-server-concurrency x engines, within
--max-concurrency).

`init_http_client(args)` also sets up, from upstream's network flags:
- `--http-proxy http://HOST:PORT`: requests to any server other than the run's own (its router and engines,
  which are always reached directly, as upstream's client never proxies them) go through that HTTP proxy:
  rewards (--rm-url) and whatever a plugin posts. (Upstream registers the flag and, at 624b824a8, reads it nowhere.)
- `--use-distributed-post`: posts are sent by Ray actors, `--actor-num-gpus-per-node` on every alive Ray node
  (upstream's count per node), taken in turn; a post whose actor fails is sent from here instead (upstream's).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from slime.rollout.settings import fleet_request_limit
from slime.utils.http_client import EngineClient, EngineError
from slime.utils.net import get_host_info  # noqa: F401  (upstream's name, here)

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 512
RETRY_INTERVAL_S = 1.0
_state: dict[str, Any] = {"concurrency": DEFAULT_CONCURRENCY, "token": None, "proxy": None, "direct": frozenset()}
_limits: dict[int, asyncio.Semaphore] = {}  # one per event loop (a semaphore belongs to its loop)
_lock = threading.Lock()
_posters: dict[str, Any] = {"actors": [], "turn": None}  # --use-distributed-post


def init_http_client(args: Any) -> None:
    """Size the client for the run: --sglang-server-concurrency requests per engine; --http-proxy and
    --use-distributed-post (module doc)."""
    proxy = getattr(args, "http_proxy", None)
    if proxy:
        _proxy_address(proxy)  # checked here: one line naming the flag
    with _lock:
        _state["concurrency"] = request_limit(args)
        _state["proxy"] = proxy or None
        _state["direct"] = frozenset(_own_servers(args))
        _limits.clear()
    if getattr(args, "use_distributed_post", False):
        _start_posters(args)


def _own_servers(args: Any) -> set[tuple[str, int]]:
    """The run's router and engines: never behind the proxy."""
    out = set()
    if getattr(args, "sglang_router_ip", None) and getattr(args, "sglang_router_port", None):
        out.add((str(args.sglang_router_ip), int(args.sglang_router_port)))
    for client in getattr(args, "rollout_engine_clients", None) or []:
        if getattr(client, "host", None) and getattr(client, "port", None):
            out.add((client.host, int(client.port)))
    for ip, port in (getattr(args, "sglang_model_routers", None) or {}).values():
        out.add((str(ip), int(port)))
    return out


def _proxy_address(proxy: str) -> str:
    parts = urlsplit(proxy)
    if parts.scheme != "http" or not parts.hostname or not parts.port or parts.path not in ("", "/"):
        raise ValueError(f"--http-proxy must look like http://host:port, got {proxy!r}")
    return f"http://{parts.hostname}:{parts.port}"


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


def _client_for(url: str, headers: dict | None, proxy: str | None, direct: frozenset) -> tuple[EngineClient, str]:
    """The client and request target: the server and its path, or, behind a proxy, the proxy and the whole URL
    (an HTTP proxy takes the absolute URI in the request line)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"url must look like http://host:port/path, got {url!r}")
    token = None
    auth = (headers or {}).get("Authorization", "")
    if auth.startswith("Bearer "):
        token = auth[len("Bearer "):]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if proxy and (parts.hostname, parts.port) not in direct:
        return EngineClient(_proxy_address(proxy), token), f"http://{parts.hostname}:{parts.port}{path}"
    return EngineClient(f"http://{parts.hostname}:{parts.port}", token), path


async def _request(method: str, url: str, payload: Any, headers: dict | None, proxy: str | None = None,
                   direct: frozenset | None = None) -> Any:
    client, path = _client_for(url, headers, proxy if proxy is not None else _state["proxy"],
                               _state["direct"] if direct is None else direct)
    async with _limit():
        return await asyncio.to_thread(client.request, method, path, payload)


async def _post_here(url: str, payload: Any, max_retries: int, headers: dict | None, proxy: str | None = None,
                     direct: frozenset | None = None) -> Any:
    attempt = 0
    while True:
        attempt += 1
        try:
            return await _request("POST", url, payload if payload is not None else {}, headers, proxy, direct)
        except (EngineError, OSError) as e:
            if attempt >= max(1, int(max_retries)):
                logger.info("POST %s failed %d times, giving up: %s", url, attempt, e)
                raise
            logger.info("POST %s failed (attempt %d/%d), retrying: %s", url, attempt, max_retries, e)
            await asyncio.sleep(RETRY_INTERVAL_S)


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict | None = None,
               proxy: str | None = None) -> Any:
    """POST JSON `payload` (None sends {}); retried once a second on any error, `max_retries` attempts.
    proxy: this request's --http-proxy (default: init_http_client's). Under --use-distributed-post a Ray
    poster actor sends it (this process, if that actor fails)."""
    actor = _next_poster()
    if actor is not None:
        try:
            return await actor.post.remote(url, payload, max_retries, headers, proxy or _state["proxy"],
                                           _state["direct"])
        except Exception as e:  # noqa: BLE001 - upstream's fallback: send it from here
            logger.info("distributed POST %s failed (%s); sending it from this process", url, e)
    return await _post_here(url, payload, max_retries, headers, proxy)


async def get(url: str, headers: dict | None = None, proxy: str | None = None) -> Any:
    """GET, decoded JSON; no retries (upstream's contract)."""
    return await _request("GET", url, None, headers, proxy)


# ------------------------------------------------------------------ --use-distributed-post
class _Poster:
    """A Ray actor that sends posts from its node (its own client and concurrency limit)."""

    def __init__(self, concurrency: int) -> None:
        with _lock:
            _state["concurrency"] = max(1, int(concurrency))
        self.sent = 0

    async def post(self, url: str, payload: Any, max_retries: int, headers: dict | None, proxy: str | None,
                   direct: frozenset) -> Any:
        self.sent += 1
        return await _post_here(url, payload, max_retries, headers, proxy or "", direct)

    def stats(self) -> dict[str, Any]:
        import ray

        return {"sent": self.sent, "node_id": ray.get_runtime_context().get_node_id()}


def _start_posters(args: Any) -> None:
    """Once per process: `--actor-num-gpus-per-node` poster actors pinned to each alive Ray node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with _lock:
        if _posters["actors"]:
            return
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        if not nodes:
            raise RuntimeError("--use-distributed-post: Ray reports no alive node to place the poster actors on")
        per_node = max(1, int(getattr(args, "actor_num_gpus_per_node", None) or 1))
        each = max(1, -(-_state["concurrency"] // (per_node * len(nodes))))
        cls = ray.remote(_Poster)
        actors = [cls.options(num_cpus=0.001, max_concurrency=each,
                              scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(each)
                  for node in nodes for _ in range(per_node)]
        _posters["actors"], _posters["turn"] = actors, itertools.cycle(range(len(actors)))


def _next_poster() -> Any:
    with _lock:
        actors = _posters["actors"]
        return actors[next(_posters["turn"])] if actors else None


def poster_actors() -> list:
    return list(_posters["actors"])


def stop_posters() -> None:
    import ray

    with _lock:
        actors, _posters["actors"], _posters["turn"] = _posters["actors"], [], None
    for actor in actors:
        ray.kill(actor)


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


def run_router(args) -> int:
    """Upstream's router entry (a multiprocessing target): sglang-router's `launch_router(args)` in this process;
    0 when it started, 1 when it could not (logged). This project's runs start the router as a subprocess
    (slime.rollout.sglang_router)."""
    try:
        from sglang_router.launch_router import launch_router

        return 0 if launch_router(args) is not None else 1
    except Exception as e:
        logger.info(e)
        return 1


def terminate_process(process, timeout: float = 1.0) -> None:
    """Stops a multiprocessing.Process: terminate, wait `timeout` seconds, then kill."""
    if not process.is_alive():
        return
    process.terminate()
    process.join(timeout=timeout)
    if process.is_alive():
        process.kill()
        process.join()
