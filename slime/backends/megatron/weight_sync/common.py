"""What the weight-sync controller and its transports share: the engines' addresses, the HTTP calls to them,
a pipeline stage's part in a sync, and the state of one sync (`SyncRound`)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from slime.utils.http_client import shared_client

GROUP_NAME = "slime_weight_sync"


class WeightSyncError(RuntimeError):
    """The engines' weights do not match the trainer's after a sync (or the engine refused an update)."""


@dataclass
class EngineEndpoint:
    url: str  # http://127.0.0.1:PORT
    tp_size: int = 1  # devices of this engine (= ranks it adds to a distributed group)
    token: str | None = None  # bearer token of the engine's control endpoints, when it requires one
    instance: int = 0  # bumped by the rollout manager at each restart: a new process, even on the same url
    # ipc: the trainer rank colocated with each engine TP rank (whose buffers that rank maps); None: rank 0
    trainer_ranks: list[int] | None = None
    # distributed: ranks the engine adds to the weight-update group; None: tp_size (SGLang: every TP rank joins;
    # the embedded engine over several processes: its rank 0, which hands the tensors to its other ranks)
    group_ranks: int | None = None
    # the rollout manager's resolved engine kind ("sglang" / "embedded"); None where the caller did not say
    kind: str | None = None

    @property
    def update_group_ranks(self) -> int:
        return self.tp_size if self.group_ranks is None else self.group_ranks

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineEndpoint":
        ranks = d.get("trainer_ranks")
        return cls(url=str(d["url"]).rstrip("/"), tp_size=int(d.get("tp_size", 1)), token=d.get("token"),
                   instance=int(d.get("instance", 0)), trainer_ranks=None if ranks is None else [int(r) for r in ranks],
                   group_ranks=None if d.get("group_ranks") is None else int(d["group_ranks"]), kind=d.get("kind"))

    def feeder(self, tp_rank: int, world_size: int) -> int:
        """The trainer rank whose payload engine TP rank `tp_rank` gets."""
        if not self.trainer_ranks:
            return 0
        if len(self.trainer_ranks) != self.tp_size:
            raise WeightSyncError(f"engine {self.url} has tp_size {self.tp_size} but {len(self.trainer_ranks)} "
                                  f"colocated trainer ranks {self.trainer_ranks}; this is a placement bug")
        return self.trainer_ranks[tp_rank] % world_size


def default_post(endpoint: EngineEndpoint, path: str, payload: dict[str, Any] | None,
                 timeout: float = 600.0) -> dict[str, Any]:
    """POST JSON to an engine; returns the decoded body, raises WeightSyncError on a non-2xx reply."""
    return _engine_call(endpoint, "POST", path, json.dumps(payload or {}).encode(), timeout)


def default_get(endpoint: EngineEndpoint, path: str, timeout: float = 60.0) -> dict[str, Any]:
    """GET JSON from an engine; returns the decoded body, raises WeightSyncError on a non-2xx reply."""
    return _engine_call(endpoint, "GET", path, None, timeout)


def _engine_call(endpoint: EngineEndpoint, method: str, path: str, data: bytes | None,
                 timeout: float) -> dict[str, Any]:
    # the process-wide client of this engine: its connection stays open across the sync's many posts
    status, body = shared_client(endpoint.url, endpoint.token).send(
        method, path, data, {"Content-Type": "application/json"} if data is not None else None, timeout)
    if status >= 300:
        detail = body.decode(errors="replace")[:500]
        raise WeightSyncError(f"{endpoint.url}{path} answered HTTP {status}" + (f": {detail}" if detail else ""))
    return json.loads(body) if body else {}


@dataclass
class StageRole:
    """This trainer rank's part in a sync under pipeline parallel (the defaults: one stage, rank 0 sends).
    barrier and gather run over all trainer ranks; gather returns every rank's object on rank 0."""

    stage: int = 0
    stages: int = 1
    sender: bool = True  # sends this stage's tensors to the engines (one rank per stage)
    barrier: Callable[[], None] = lambda: None
    gather: Callable[[Any], list[Any] | None] = lambda obj: [obj]

    @property
    def group_name(self) -> str:
        return GROUP_NAME if self.stages == 1 else f"{GROUP_NAME}_pp{self.stage}"


@dataclass
class SyncRound:
    """One sync as the transports see it: its weight version, its first failure (after which the export only
    drains: no transport sends more) and the checksums the engines sent back with the updates."""

    version: int
    failed: BaseException | None = None
    reported: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # engine url -> name -> checksum

    def fail(self, error: BaseException) -> None:
        self.failed = self.failed or error

    def report(self, url: str, checksums: Any) -> None:
        if isinstance(checksums, dict):
            self.reported.setdefault(url, {}).update(checksums)


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def check_reply(reply: dict[str, Any], what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightSyncError(f"engine refused {what}: {reply.get('message', reply)}")


class EngineCalls:
    """HTTP calls to several engines on their own threads; errors are kept (first one raised on demand).
    `calls`: (engine, path, payload) posted through `post`, or with `fn`: fn(payload, engine) is called."""

    def __init__(self, post: Callable[..., dict[str, Any]], calls: list[tuple],
                 fn: Callable[..., None] | None = None) -> None:
        self.errors: list[BaseException] = []
        self.threads: dict[str, threading.Thread] = {}

        def run(engine: EngineEndpoint, path: str | None, arg: Any) -> None:
            try:
                if fn is not None:
                    fn(arg, engine)
                else:
                    check_reply(post(engine, path, arg), f"{path.lstrip('/')} ({engine.url})")
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                self.errors.append(e)

        for engine, path, arg in calls:
            t = threading.Thread(target=run, args=(engine, path, arg), daemon=True)
            self.threads[engine.url] = t
            t.start()

    def first_error(self) -> BaseException | None:
        return self.errors[0] if self.errors else None

    def pending_urls(self) -> list[str]:
        return [u for u, t in self.threads.items() if t.is_alive()]

    def wait(self, timeout: float | None) -> "EngineCalls":
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads.values():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
