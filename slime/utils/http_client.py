"""The one HTTP client of slime: rollout engines (embedded and SGLang), the sglang-router and the weight sync.

    client = EngineClient("http://127.0.0.1:30000", token)
    out = client.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0}, return_logprob=True)
    client.update_weights_from_tensor([(name, tensor), ...])   # IPC handles, no copy

`HttpClient` keeps one HTTP/1.1 connection per thread and host open between requests (the embedded engine
and SGLang keep connections alive), reconnecting once when the server had closed an idle one.
One error taxonomy: `EngineError` (the server answered with an error status, or JSON `success: false`;
`.status`, one-line `.message`) and its subclass `EngineUnreachable` (no answer: not up, down, or timed out;
also a ConnectionError, status 0). Nothing else in slime/ speaks HTTP through urllib or http.client.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

if TYPE_CHECKING:  # annotations only: processes that only post (http_utils' poster actors) never import torch
    import torch


class EngineError(RuntimeError):
    def __init__(self, url: str, path: str, status: int, message: str) -> None:
        super().__init__(f"{url}{path}: HTTP {status}: {message}")
        self.url, self.path, self.status, self.message = url, path, status, message
        self._init_args: tuple = (url, path, status, message)

    def __reduce__(self):
        # Raised inside Ray actors and re-raised on the driver: the default reduction would call __init__
        # with the formatted text alone, and the driver would get "Failed to deserialize exception".
        return type(self), self._init_args


class EngineUnreachable(EngineError, ConnectionError):
    def __init__(self, url: str, path: str, cause: BaseException) -> None:
        super().__init__(url, path, 0, f"cannot reach engine ({type(cause).__name__}: {cause})")
        self._init_args = (url, path, cause)


# A kept-alive connection the server closed while idle fails with one of these before any reply: the
# request never ran, so it is sent once more on a new connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class HttpClient:
    """JSON over HTTP/1.1 to one server (http://host:port), a persistent connection per calling thread."""

    def __init__(self, url: str, token: str | None = None, timeout: float | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"server url must look like http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port
        self.token = token
        self.timeout = timeout
        self._local = threading.local()
        # Weak: a connection lives as long as its thread (rollout worker threads come and go; when one ends,
        # its connection is collected and its socket closed, so the server's thread for it ends too).
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"

    def __getstate__(self) -> dict[str, Any]:  # connections stay in their process
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_open", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local, self._open, self._lock = threading.local(), weakref.WeakSet(), threading.Lock()

    # ------------------------------------------------------------------ transport
    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """(this thread's connection, whether it carried a request before)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _discard(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Close every connection this client holds (any thread's)."""
        with self._lock:
            conns, self._open = list(self._open), weakref.WeakSet()
        for conn in conns:
            conn.close()
        self._local = threading.local()

    def send(self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None,
             timeout: float | None = None) -> tuple[int, bytes]:
        """One request: (status, body bytes) whatever the status; EngineUnreachable when there is no answer."""
        headers = dict(headers or {})
        if self.token:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        for attempt in (0, 1):
            conn, reused = self._connection()
            conn.timeout = timeout or self.timeout
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except _STALE as e:
                self._discard(conn)
                if reused and attempt == 0:
                    continue
                raise EngineUnreachable(self.url, path, e) from e
            except (ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
                self._discard(conn)  # a late reply must not be read as the next request's
                raise EngineUnreachable(self.url, path, e) from e
            if resp.will_close:
                self._discard(conn)
            return resp.status, raw
        raise AssertionError("unreachable")  # pragma: no cover

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """JSON in, JSON out (text when the reply is not JSON); EngineError on an error status or success=false."""
        data = json.dumps(body).encode() if body is not None else None
        status, raw = self.send(method, path, data, {"Content-Type": "application/json"}, timeout)
        try:
            obj = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            obj = raw.decode(errors="replace")
        if status >= 400:
            raise EngineError(self.url, path, status, _message(obj))
        if isinstance(obj, dict) and obj.get("success") is False:
            raise EngineError(self.url, path, status, _message(obj))
        return obj

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, None, timeout)

    def post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return self.request("POST", path, body if body is not None else {}, timeout)


_SHARED: dict[tuple[str, str | None], HttpClient] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(url: str, token: str | None = None) -> HttpClient:
    """One client per (server, token) in this process, so callers that only hold a URL (the weight sync's
    endpoints) still reuse connections."""
    key = (url.rstrip("/"), token)
    with _SHARED_LOCK:
        client = _SHARED.get(key)
        if client is None:
            client = _SHARED[key] = HttpClient(url, token)
        return client


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]], acc: Any = None) -> str:
    """SGLang's `serialized_named_tensors` entry for one TP rank: base64 of the accelerator's IPC payload."""
    from slime.accelerator import get_accelerator
    from slime.accelerator.ipc import serialize_named_tensors

    return base64.b64encode(serialize_named_tensors(acc or get_accelerator(), list(named))).decode("ascii")


class EngineClient(HttpClient):
    """SGLang's engine API (the embedded engine serves the same endpoints)."""

    # ------------------------------------------------------------------ health
    def health(self, timeout: float = 5.0) -> bool:
        try:
            self.get("/health", timeout=timeout)
            return True
        except EngineError:
            return False

    def wait_healthy(self, timeout: float = 600.0, alive: Callable[[], bool] | None = None,
                     interval: float = 0.2) -> None:
        """Poll /health until it answers; `alive()` returning False (process exited) stops early."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health(timeout=min(5.0, interval * 10)):
                return
            if alive is not None and not alive():
                raise EngineUnreachable(self.url, "/health", RuntimeError("engine process exited before it was healthy"))
            time.sleep(interval)
        raise EngineUnreachable(self.url, "/health", TimeoutError(f"not healthy after {timeout:.0f}s"))

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict | list | None = None,
                 return_logprob: bool = False, rid: str | None = None, timeout: float | None = None,
                 return_routed_experts: bool = False, return_indexer_topk: bool = False) -> Any:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                                "return_logprob": return_logprob}
        if return_routed_experts:  # SGLang's meta_info["routed_experts"] (MoE routing replay)
            body["return_routed_experts"] = True
        if return_indexer_topk:  # SGLang's meta_info["indexer_topk"] (DSA indexer top-k replay)
            body["return_indexer_topk"] = True
        if rid is not None:
            body["rid"] = rid
        return self.post("/generate", body, timeout)

    def get_model_info(self) -> dict[str, Any]:
        return self.get("/get_model_info")

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> None:
        self.post("/flush_cache")

    def pause_generation(self, mode: str = "abort") -> None:
        self.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.post("/continue_generation", {})

    def abort_all(self) -> None:
        self.post("/abort_request", {"abort_all": True})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.post("/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.post("/resume_memory_occupation", {"tags": tags} if tags else {})

    # ------------------------------------------------------------------ weights
    def update_weights_from_tensor(self, named: Sequence[tuple[str, torch.Tensor]], load_format: str | None = None,
                                   weight_version: str | None = None, flush_cache: bool = False) -> dict:
        """Send weights by IPC handle (tensors must stay alive until this returns).
        `load_format="flattened_bucket"` packs them into one SGLang FlattenedTensorBucket (see flattened_bucket.py)."""
        body: dict[str, Any] = {"load_format": load_format, "flush_cache": flush_cache, **_version(weight_version)}
        if load_format == "flattened_bucket":
            from slime.accelerator import get_accelerator
            from slime.accelerator.ipc import serialize_flattened_bucket
            from slime.backends.embedded.flattened_bucket import pack

            flat, meta = pack(list(named))  # alive until the reply
            body["serialized_named_tensors"] = [
                base64.b64encode(serialize_flattened_bucket(get_accelerator(), flat, meta)).decode()]
        else:
            body["serialized_named_tensors"] = [encode_named_tensors(named)]
        return self.post("/update_weights_from_tensor", body)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout: float | None = None) -> dict:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name}
        if backend:
            body["backend"] = backend
        return self.post("/init_weights_update_group", body, timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str | None = None,
                                        flush_cache: bool = False, timeout: float | None = None) -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, **_version(weight_version)}
        return self.post("/update_weights_from_distributed", body, timeout)

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self.post("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        return self.post("/update_weights_from_disk", {"model_path": model_path, **_version(weight_version)})


def _version(weight_version: Any) -> dict[str, str]:
    """The optional `weight_version` field of a weight-update body (engines report it back)."""
    return {} if weight_version is None else {"weight_version": str(weight_version)}


def _message(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in obj:
            return str(obj["message"])
        if "detail" in obj:
            return str(obj["detail"])
    return str(obj)[:500]
