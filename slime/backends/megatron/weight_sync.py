"""Trainer -> rollout engine weight sync, through the accelerator, over SGLang's HTTP protocol.

ipc (colocated) to one engine that offers weight sets (`"weight_sets"` in /get_model_info lists the
export's expert layout: the embedded engine in one process on host memory): the engine's weights live
in two shared buffers this rank allocates once (slime.backends.embedded.weight_sets); each exported
tensor is copied once, straight into its place in the set the engine does not read, in the engine's
layout (expert weights in megatron's [in, out] order, so no transpose), and `/commit_weight_sets`
switches the engine to it, all or nothing (checked against the written bytes' checksums with
--check-weight-sync). One copy per byte, where the shared buckets below cost two.

ipc (colocated), otherwise: the tensors of `export_hf` are copied once into flat uint8 buffers shared with the
engines (`shared_buckets.SharedBucketSender`: two sets, one posted while the export fills the other).
Each post is SGLang's `/update_weights_from_tensor` with `load_format: "flattened_bucket"` and one
payload per engine TP rank (slime.utils.tensor_bucket): payload j holds the buffer of the trainer rank
colocated with the engine's TP rank j (its `trainer_ranks`), so every engine rank maps memory on its own
device. Every such trainer rank packs the same export; rank 0 collects the others' payloads for each
flush through the default group's store (`PayloadExchange`), posts, and hands the verdict back, so all
ranks end a sync with the same outcome. Generation is paused around the update.

distributed: trainer rank 0 and every engine device form one collective group the way SGLang's
`init_weights_update_group` does (slime.utils.distributed); per bucket, names/dtypes/shapes go over HTTP
(`/update_weights_from_distributed`) while rank 0 broadcasts the tensors. An engine that refuses (or a
broadcast that does not finish within --update-weight-timeout) aborts the group on every side and the
sync fails with one line naming the engine; the group is formed again at the next sync.

Pipeline parallel: every stage exports its own layers, and one rank per stage (TP/EP/DP rank 0 of the
stage) sends them: its own shared buffers (ipc), or its own collective group with the engines, named per
stage (distributed). Trainer rank 0 pauses the engines before any stage sends, collects every stage's
checksums, byte counts and errors, then flushes, resumes and verifies them all: the engines receive each
tensor of the model once per sync, and the check covers every stage.

Whatever fails, every engine is asked to flush its cache (retried while it is busy) and to continue
generating before `sync` returns or raises.

auto: ipc when colocated and the device supports IPC, else distributed (logged once).
After every sync the engine's weight checksums (`/get_weights_checksum`) must equal the trainer's
exported weights (for ipc: computed on the shared buffers the engines read); a mismatch raises
`WeightSyncError`. That endpoint is slime's extension: an engine
serves it when its `/get_model_info` says `"weights_checksum": true` (the embedded engine); for any
other engine (SGLang) the check is skipped with one log line per engine.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from slime.accelerator import get_accelerator
from slime.utils import weight_checksum
from slime.utils.http_client import shared_client

logger = logging.getLogger(__name__)

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

    @property
    def update_group_ranks(self) -> int:
        return self.tp_size if self.group_ranks is None else self.group_ranks

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineEndpoint":
        ranks = d.get("trainer_ranks")
        return cls(url=str(d["url"]).rstrip("/"), tp_size=int(d.get("tp_size", 1)), token=d.get("token"),
                   instance=int(d.get("instance", 0)), trainer_ranks=None if ranks is None else [int(r) for r in ranks],
                   group_ranks=None if d.get("group_ranks") is None else int(d["group_ranks"]))

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


def resolve_mode(requested: str, colocate: bool, ipc_capable: bool) -> str:
    if requested == "ipc":
        if not ipc_capable:
            raise WeightSyncError("--update-weight-mode ipc: this device cannot share tensors across processes; "
                                  "use --update-weight-mode distributed (or auto)")
        return "ipc"
    if requested == "distributed":
        return "distributed"
    if colocate and ipc_capable:
        return "ipc"
    if colocate:
        logger.warning("device has no IPC tensor sharing: colocated weight sync falls back to the distributed path")
    return "distributed"


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


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _check_reply(reply: dict[str, Any], what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightSyncError(f"engine refused {what}: {reply.get('message', reply)}")


class PayloadExchange:
    """Per ipc flush: every other feeding trainer rank hands rank 0 its payloads, rank 0 hands back the
    verdict ("" = posted, else the error's first line). Runs on the senders' worker threads, so it goes
    through the default group's key-value store (thread-safe, no collective). Every wait is bounded."""

    _instances = 0  # keys of a new WeightSync never meet a failed predecessor's leftovers

    def __init__(self, store: Any, rank: int, timeout_s: float) -> None:
        PayloadExchange._instances += 1
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.prefix = f"slime/weight_sync/{PayloadExchange._instances}"

    def _take(self, key: str, what: str) -> str:
        from datetime import timedelta

        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except Exception:  # the store's timeout error; one line for the user
            raise WeightSyncError(f"weight sync: {what} did not arrive within {self.timeout_s:.0f} s "
                                  "(--update-weight-timeout); another trainer rank failed or is stuck") from None
        value = self.store.get(key).decode()
        self.store.delete_key(key)
        return value

    def send_payloads(self, flush: tuple[int, int], payloads: dict[str, str]) -> str:
        """Non-zero rank: publish this rank's payloads for `flush`, return rank 0's verdict."""
        import json

        base = f"{self.prefix}/{flush[0]}/{flush[1]}"
        self.store.set(f"{base}/payload/{self.rank}", json.dumps(payloads))
        return self._take(f"{base}/verdict/{self.rank}", f"rank 0's answer to flush {flush[1]}")

    def collect(self, flush: tuple[int, int], ranks: list[int]) -> dict[str, str]:
        import json

        base, out = f"{self.prefix}/{flush[0]}/{flush[1]}", {}
        for r in ranks:
            out.update(json.loads(self._take(f"{base}/payload/{r}", f"trainer rank {r}'s payload of flush {flush[1]}")))
        return out

    def answer(self, flush: tuple[int, int], ranks: list[int], verdict: str) -> None:
        base = f"{self.prefix}/{flush[0]}/{flush[1]}"
        for r in ranks:
            self.store.set(f"{base}/verdict/{r}", verdict)


class WeightSync:
    """Runs on every trainer rank (export is collective); rank 0 talks to the engines."""

    def __init__(self, mode: str, export: Callable[[], Iterable[list[tuple[str, torch.Tensor]]]],
                 engines: list[EngineEndpoint], rank: int, check: bool = True,
                 post: Callable[..., dict[str, Any]] = default_post,
                 get: Callable[..., dict[str, Any]] = default_get, buffer_bytes: int = 64 << 20,
                 world_size: int = 1, timeout_s: float = 600.0, exchange: PayloadExchange | None = None,
                 role: StageRole | None = None, expert_layout: str = "in_out") -> None:
        self.mode, self.export, self.engines, self.rank = mode, export, engines, rank
        self.role = role or StageRole(sender=rank == 0)
        self.controller = rank == 0  # pauses, resumes and verifies the engines
        self.check, self.post, self.get = check, post, get
        self.buffer_bytes = buffer_bytes  # ipc: capacity of each shared buffer
        self.world_size, self.timeout_s = world_size, timeout_s
        self.exchange = exchange  # ipc with other feeding ranks: how their payloads reach rank 0
        self.group = None
        self._group_host = None  # distributed: the rendezvous store rank 0 hosts for the group
        self.syncs = 0
        self._checksum_support: dict[str, bool] = {}  # per engine url: serves /get_weights_checksum
        self._info: dict[str, dict[str, Any]] = {}  # per engine url: its /get_model_info (asked once)
        self._reported: dict[str, dict[str, list[int]]] = {}  # this sync: checksums engines sent with updates
        self._sender = None  # ipc: SharedBucketSender, kept across syncs while the engines take flat buffers
        self._failed: BaseException | None = None  # this sync's first failure (the rest of it only drains)
        self.last_split: dict[str, float] = {}  # seconds of the last sync's parts (see sync)
        # distributed: the buckets sent and not yet answered, oldest first (engine calls, broadcast works,
        # deadline), the updates numbered on the current group, and the two send buffers
        self._in_flight: list[tuple] = []
        self._dist_sequence = 0
        self._dist_buffers: list[torch.Tensor | None] = [None, None]
        self._dist_next = 0
        # ipc to an engine that offers weight sets: the layout the export's expert weights come in ("in_out":
        # megatron's [in, out], handed out as transposed views; "hf": contiguous HF tensors) and, per engine
        # process, the sets this rank writes
        self.expert_layout = expert_layout
        self._set_writers: dict[tuple[str, int], Any] = {}

    # --- set-up ---------------------------------------------------------------------------
    def connect(self) -> None:
        """distributed: form the weight-update group with every engine (rank 0)."""
        if self.mode != "distributed" or not self.role.sender:
            return
        from slime.backends.megatron.actor import _node_ip
        from slime.utils.distributed import GroupHost
        from slime.utils.net import free_port

        addr, port = _node_ip(), free_port("")
        world = 1 + sum(e.update_group_ranks for e in self.engines)
        backend = get_accelerator().process_group_backend()
        host = GroupHost(addr, port, world, self.role.group_name, backend, self.timeout_s)
        calls, offset = [], 1
        for engine in self.engines:
            calls.append((engine, "/init_weights_update_group", {
                "master_address": addr, "master_port": port, "rank_offset": offset, "world_size": world,
                "group_name": self.role.group_name, "backend": backend}))
            offset += engine.update_group_ranks
        threads = _EngineCalls(self, calls)
        try:
            self.group = host.join(refused=threads.first_error)
        except BaseException as e:
            host.abort()  # stops the store: rendezvous still waiting on it fail, here and in the engines
            threads.wait(30)
            self._destroy_on_engines()
            raise WeightSyncError(f"weight-update group not formed: {str(e).splitlines()[0] if str(e) else e!r}; "
                                  "every engine was asked to destroy it") from None
        threads.wait(self.timeout_s)
        self._group_host = host
        self._dist_sequence = 0
        threads.raise_first()

    def set_engines(self, engines: list[EngineEndpoint]) -> bool:
        """Take the rollout manager's current engine list (asked before every sync): an engine restarted
        (new instance, maybe a new port) or gone since the last sync. ipc: the new list is used as is;
        distributed: the weight-update group is destroyed and formed again with the current engines (a
        restarted engine process is not in the old group). Returns whether anything changed."""
        if engines == self.engines:
            return False
        if not engines:
            raise WeightSyncError("the rollout manager reports no running engine; nothing to sync weights to")
        old = {(e.url, e.instance) for e in self.engines}
        logger.info("rollout engines changed since the last weight sync (now: %s)",
                    ", ".join(f"{e.url}#{e.instance}" + ("" if (e.url, e.instance) in old else " new") for e in engines))
        regroup = self.mode == "distributed" and self.role.sender and self.group is not None
        if regroup:
            self._drop_group()
        self.engines = list(engines)
        for e in engines:
            if (e.url, e.instance) not in old:
                self._checksum_support.pop(e.url, None)
                self._info.pop(e.url, None)
        if regroup:
            self.connect()
        return True

    def _destroy_on_engines(self) -> None:
        for engine in self.engines:
            try:
                self.post(engine, "/destroy_weights_update_group", {"group_name": self.role.group_name}, timeout=30)
            except Exception:
                pass

    def _drop_group(self, aborted: bool = False) -> None:
        """Leave the weight-update group on every side. aborted: a broadcast may still be pending, so the
        group is aborted and released in the background (releasing waits for gloo's pending work)."""
        if self.group is None:
            return
        from slime.utils.distributed import destroy_custom_process_group

        group, host, self.group, self._group_host = self.group, self._group_host, None, None
        self._dist_sequence = 0
        if aborted:
            from slime.utils.distributed import abort_custom_process_group

            abort_custom_process_group(group)
        self._destroy_on_engines()
        if aborted:
            threading.Thread(target=destroy_custom_process_group, args=(group,), daemon=True,
                             name="weight-sync-group-release").start()
        else:
            destroy_custom_process_group(group)
        if host is not None:
            host.close()

    def close(self) -> None:
        self._dist_buffers = [None, None]
        self._set_writers = {}
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self.role.sender:
            self._drop_group()

    # --- one sync -------------------------------------------------------------------------
    def _all_engines(self, path: str, payload: dict[str, Any]) -> None:
        for engine in self.engines:
            _check_reply(self.post(engine, path, payload), path)

    def _resume_all(self) -> None:
        """Flush the cache (retried while the engine is busy) and continue generation on every engine; every
        engine is asked even when another fails. Raises the first failure afterwards."""
        errors: list[BaseException] = []
        for engine in self.engines:
            for step in (self._flush_cache, lambda e: _check_reply(self.post(e, "/continue_generation", {}, timeout=60),
                                                                   "/continue_generation")):
                try:
                    step(engine)
                except Exception as e:  # noqa: BLE001 - reported after every engine was asked
                    errors.append(e)
        if errors:
            raise errors[0]

    def _flush_cache(self, engine: EngineEndpoint, budget_s: float = 60.0) -> None:
        """SGLang answers /flush_cache with a non-200 while requests are in flight: retry until idle (bounded)."""
        deadline = time.monotonic() + budget_s
        while True:
            try:
                _check_reply(self.post(engine, "/flush_cache", {}, timeout=30), "/flush_cache")
                return
            except WeightSyncError as e:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{engine.url}/flush_cache still refused after {budget_s:.0f} s: "
                                          f"{str(e).splitlines()[0]}") from None
                time.sleep(0.2)

    def _feeds(self, rank: int) -> list[tuple[int, int]]:
        """(engine index, engine TP rank) pairs whose payload trainer rank `rank` provides (ipc). Under pipeline
        parallel each stage's sender feeds every engine rank with its stage's tensors."""
        if self.role.stages > 1:
            return [(i, j) for i, e in enumerate(self.engines) for j in range(e.tp_size)] \
                if rank == self.rank and self.role.sender else []
        return [(i, j) for i, e in enumerate(self.engines) for j in range(e.tp_size)
                if e.feeder(j, self.world_size) == rank]

    def sync(self, version: int, engines: list[EngineEndpoint] | None = None) -> dict[str, float]:
        """Push the current weights to every engine (`engines`: the manager's current list, see
        `set_engines`); returns timing/size metrics: time/weight_sync and its split into
        time/weight_sync_export (export and packing on this thread, which the posts overlap),
        time/weight_sync_wait (waiting for the engines after the export), time/weight_sync_control
        (pause/flush/continue) and time/weight_sync_verify (engine checksums and the comparison).
        With --check-weight-sync, engines that can answer an update with the checksums of the weights it
        changed (`"update_checksums": true`) are asked to; others are asked with /get_weights_checksum.
        A failure anywhere still drains the export (its collectives) and resumes every engine, then raises."""
        t0 = time.perf_counter()
        leader = self.role.sender
        if engines is not None:
            self.set_engines(engines)
        sent_bytes, expected, control, verify = 0, {}, 0.0, 0.0
        self._reported, self._failed = {}, None
        metrics: dict[str, float] = {}
        t_export = t_wait = t_done = time.perf_counter()
        error: BaseException | None = None
        try:
            if self.controller:  # (the cache is flushed once, after the update, before generation continues)
                control = self._timed(lambda: self._all_engines("/pause_generation", {}))
        except BaseException as e:  # noqa: BLE001 - the other ranks still meet at the barrier and the gather
            error = e
        self.role.barrier()  # every stage sends only once the engines are paused
        try:
            packs = self.mode == "ipc" and (leader or bool(self._feeds(self.rank)))
            sender = self._ipc_sender(version) if packs else None
            t_export = time.perf_counter()
            for bucket in self.export():
                if sender is not None:  # also after a failure: every feeding rank packs the same flushes
                    sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    for name, t in bucket:
                        sender.add(name, t)
                elif leader and self.mode == "distributed" and self._failed is None and error is None:
                    sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    if self.check:
                        expected.update(weight_checksum.named_checksums(bucket))
                    try:
                        self._send_distributed(bucket, version)
                    except BaseException as e:  # keep iterating: the other ranks are in the export's collectives
                        self._failed = e
                del bucket
            t_wait = time.perf_counter()
            if leader and self.mode == "distributed":
                try:
                    self._finish_distributed()  # the last bucket (also after a failure: nothing left on the wire)
                except BaseException as e:  # noqa: BLE001 - raised below with the first failure
                    self._failed = self._failed or e
            if sender is not None:
                try:
                    expected = sender.finish()
                finally:
                    if not sender.reuse:
                        sender.close()
                        self._sender = None
            if self._failed is not None:
                raise self._failed
            t_done = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - gathered below, so every rank ends the same way
            error = error or e
            if self._in_flight:  # the export itself failed with a bucket on the wire
                try:
                    self._finish_distributed()
                except BaseException:  # noqa: BLE001 - the first error is the one reported
                    pass
        parts = self.role.gather((sent_bytes, expected if leader else {}, self._reported,
                                  None if error is None else _line(error)))
        try:
            if self.controller and parts:  # every stage's tensors, checksums, engine replies and errors
                sent_bytes, expected, self._reported = 0, {}, {}
                for part_bytes, part_expected, part_reported, part_error in parts:
                    sent_bytes += part_bytes
                    expected.update(part_expected)
                    for url, sums in part_reported.items():
                        self._reported.setdefault(url, {}).update(sums)
                    if error is None and part_error is not None:
                        error = WeightSyncError(part_error)
            if error is not None:
                raise error
        finally:
            if self.controller:
                t_resume = time.perf_counter()
                try:
                    self._resume_all()
                finally:
                    control += time.perf_counter() - t_resume
        metrics["weight_sync/bytes"] = float(sent_bytes)
        if self.controller and self.check:
            t_verify = time.perf_counter()
            metrics["weight_sync/checked_tensors"] = float(self.verify(expected))
            verify = time.perf_counter() - t_verify
        self.syncs += 1
        metrics["time/weight_sync"] = time.perf_counter() - t0
        metrics.update({"time/weight_sync_export": t_wait - t_export, "time/weight_sync_wait": t_done - t_wait,
                        "time/weight_sync_control": control, "time/weight_sync_verify": verify})
        self.last_split = {k: v for k, v in metrics.items() if k.startswith("time/")}
        return metrics

    @staticmethod
    def _timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def engine_info(self, engine: EngineEndpoint) -> dict[str, Any]:
        """The engine's /get_model_info (asked once per engine process); {} when it cannot be read."""
        info = self._info.get(engine.url)
        if info is None:
            try:
                info = self.get(engine, "/get_model_info")
                info = info if isinstance(info, dict) else {}
            except Exception as e:
                info = {"_error": str(e).splitlines()[0] if str(e) else type(e).__name__}
            self._info[engine.url] = info
        return info

    def takes_flat_buffers(self, engine: EngineEndpoint) -> bool:
        """Whether the engine has read the shared buffers when it replies (`"flattened_bucket": true`), so they
        can be refilled; SGLang engines get new buffers for every flush."""
        return self.engine_info(engine).get("flattened_bucket") is True

    def _ipc_sender(self, version: int):
        """The shared-buffer sender for this sync: reused across flushes and syncs when every engine has read the
        buffers when it replies; a fresh one, not reusing buffers, otherwise. On a synchronized device (CPU)
        every engine has: its copies are complete when they return, SGLang's CPU backend's too. On a GPU/NPU
        SGLang replies with its copies possibly still queued on its stream, so only engines that synchronize
        before replying (`"flattened_bucket": true`, the embedded engine) get refilled buffers there."""
        from slime.backends.megatron.shared_buckets import SharedBucketSender

        acc = get_accelerator()
        engine = self._weight_set_engine()
        if engine is not None:
            return self._weight_set_sync(engine, version)
        reuse = acc.is_synchronized_device() or all(self.takes_flat_buffers(e) for e in self.engines)
        if self._sender is None or self._sender.reuse != reuse:
            if self._sender is not None:
                self._sender.close()
            share = acc.reduce_tensor if acc.memory_is_host() else None  # into shared memory once, at allocation
            self._sender = SharedBucketSender(self.buffer_bytes, acc.device(), self._post_packed, reuse=reuse,
                                              share=share)
        self._sender.checksums = self.check and self.role.sender
        self._sender.flushes = 0  # flush numbers key the payload exchange: the same on every rank
        self._version = version
        return self._sender

    def takes_weight_sets(self, engine: EngineEndpoint) -> bool:
        """Whether the engine's weights can live in weight sets this trainer writes (`"weight_sets"` in its
        /get_model_info lists this export's expert layout: the embedded engine in one process on host memory)."""
        layouts = self.engine_info(engine).get("weight_sets")
        return isinstance(layouts, list) and self.expert_layout in layouts

    def _weight_set_engine(self) -> EngineEndpoint | None:
        """The engine to sync through weight sets: one engine of one process fed by this rank alone (pipeline
        stage 1 of 1), on host memory, that offers them; else None (shared buckets)."""
        if (self.mode != "ipc" or not self.role.sender or self.role.stages != 1 or len(self.engines) != 1
                or not get_accelerator().memory_is_host()):
            return None
        engine = self.engines[0]
        if engine.tp_size != 1 or self._feeds(self.rank) != [(0, 0)] or not self.takes_weight_sets(engine):
            return None
        return engine

    def _weight_set_sync(self, engine: EngineEndpoint, version: int) -> "_WeightSetSync":
        """This sync's writer into the engine's weight sets: the sets are allocated and attached once per engine
        process (again when the engine has dropped them, e.g. after releasing its weights)."""
        from slime.accelerator.ipc import serialize_named_tensors
        from slime.backends.megatron.shared_buckets import WeightSetWriter

        acc = get_accelerator()
        key = (engine.url, engine.instance)
        writer = self._set_writers.get(key)
        state = self.post(engine, "/weight_sets_state", {"layout_id": writer.layout_id if writer else None})
        _check_reply(state, f"weight_sets_state ({engine.url})")
        if not state.get("attached"):
            layout = self.post(engine, "/weight_sets_layout", {"expert_layout": self.expert_layout})
            _check_reply(layout, f"weight_sets_layout ({engine.url})")
            if writer is None or writer.layout_id != layout["layout_id"]:
                writer = None
                self._set_writers = {}  # the buffers of an engine process that is gone
                writer = WeightSetWriter(layout, acc.device(), share=acc.reduce_tensor)
            handles = base64.b64encode(serialize_named_tensors(acc, [("0", writer.sets[0]), ("1", writer.sets[1])]))
            state = self.post(engine, "/attach_weight_sets", {"layout_id": writer.layout_id,
                                                               "serialized_named_tensors": [handles.decode()]})
            _check_reply(state, f"attach_weight_sets ({engine.url})")
        self._set_writers = {key: writer}
        writer.begin(state)
        return _WeightSetSync(self, engine, writer, version)

    def _post_packed(self, packed) -> None:
        """One flush (on the sender's worker thread): this rank's payloads for the engine TP ranks it feeds;
        rank 0 adds the other ranks' (PayloadExchange) and posts every engine its list, one per TP rank."""
        acc = get_accelerator()
        flush = (self.syncs, packed.index)
        mine = {f"{i}/{j}": packed.flattened_payload(acc) for i, j in self._feeds(self.rank)}
        if not self.role.sender:
            verdict = self.exchange.send_payloads(flush, mine) if self.exchange is not None else ""
            if verdict:
                raise WeightSyncError(verdict)
            return
        others = sorted({r for r in range(self.world_size) if r != self.rank and self._feeds(r)})
        if others and self.exchange is None:
            raise WeightSyncError("engines are colocated with trainer ranks other than 0 but no payload exchange is "
                                  "set up (create_weight_sync sets one when torch.distributed is initialized)")
        verdict = ""
        try:
            payloads = {**mine, **(self.exchange.collect(flush, others) if others else {})}
            if self._failed is None:
                self._post_all(packed, payloads)
        except BaseException as e:
            self._failed = self._failed or e
            raise
        finally:
            if self._failed is not None:
                verdict = str(self._failed).splitlines()[0] if str(self._failed) else type(self._failed).__name__
            if others:
                self.exchange.answer(flush, others, verdict)
        if self._failed is not None:
            raise self._failed

    def _post_all(self, packed, payloads: dict[str, str]) -> None:
        def post(i: int, engine: EngineEndpoint) -> None:
            body: dict[str, Any] = {"flush_cache": False, "weight_version": str(self._version),
                                    "load_format": "flattened_bucket",
                                    "serialized_named_tensors": [payloads[f"{i}/{j}"] for j in range(engine.tp_size)]}
            if self.check and self.engine_info(engine).get("update_checksums") is True:
                body["return_checksums"] = True
            reply = self.post(engine, "/update_weights_from_tensor", body)
            _check_reply(reply, f"update_weights_from_tensor ({engine.url})")
            if body.get("return_checksums") and isinstance(reply, dict) and isinstance(reply.get("checksums"), dict):
                self._reported.setdefault(engine.url, {}).update(reply["checksums"])

        if len(self.engines) == 1:
            post(0, self.engines[0])
            return
        _EngineCalls(self, [(e, None, i) for i, e in enumerate(self.engines)], fn=post).wait(None).raise_first()

    def takes_flat_broadcasts(self) -> bool:
        """Whether every engine takes /update_weights_from_distributed with load_format flattened_bucket
        (`"distributed_flattened_bucket": true`, the embedded engine): one broadcast per bucket."""
        return all(self.engine_info(e).get("distributed_flattened_bucket") is True for e in self.engines)

    def takes_sequenced_updates(self) -> bool:
        """Whether every engine takes a "sequence" number with /update_weights_from_distributed
        (`"distributed_sequence": true`, the embedded engine): then the next bucket goes on the wire as soon
        as the previous one is received, while the engines still copy it into their weights."""
        return all(self.engine_info(e).get("distributed_sequence") is True for e in self.engines)

    def _send_distributed(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Start sending one bucket: its names to every engine over HTTP while rank 0 broadcasts its tensors.
        Engines that take flattened buckets get the bucket's bytes in one broadcast, packed (widest dtype
        first, so SGLang's gapless layout keeps every tensor aligned) into one of two send buffers kept
        across buckets and syncs; other engines one broadcast per tensor. The previous bucket's broadcast
        finishes first (a group carries one broadcast at a time) but after this one is packed: the export and
        packing of a bucket overlap the broadcast of the one before. Engines that take numbered updates
        (`takes_sequenced_updates`) get this bucket while they still copy the previous one (its reply is
        awaited before the next bucket, so a send buffer is refilled only once its bucket is received);
        others answer each bucket before the next is sent (`_finish_distributed` waits for the last)."""
        from slime.backends.megatron.shared_buckets import pack_into
        from slime.utils.distributed import broadcast_async

        if self.group is None:
            self.connect()
        device = get_accelerator().device()
        flat = self.takes_flat_broadcasts()
        if flat:
            bucket = sorted(bucket, key=lambda nt: -nt[1].element_size())  # stable: export order within a dtype
            starts, nbytes = [], 0
            for _, t in bucket:
                starts.append(nbytes)
                nbytes += t.numel() * t.element_size()
            slot, self._dist_next = self._dist_next, 1 - self._dist_next
            buffers = self._dist_buffers
            if buffers[slot] is None or buffers[slot].numel() < nbytes or buffers[slot].device != device:
                buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            pack_into(buffers[slot], [(o, t.to(device)) for o, (_, t) in zip(starts, bucket)])
            get_accelerator().synchronize()  # packed before the broadcast reads it
            tensors = [buffers[slot][:nbytes]]
        else:
            tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.role.group_name, "flush_cache": False,
                   "weight_version": str(version)}
        if flat:
            payload["load_format"] = "flattened_bucket"
        sequenced = self.takes_sequenced_updates()
        if sequenced:
            payload["sequence"] = self._dist_sequence
        self._finish_distributed(keep_last=sequenced)
        # The engines block in the broadcast until rank 0 sends, so their HTTP calls run alongside.
        calls = _EngineCalls(self, [(e, "/update_weights_from_distributed", payload) for e in self.engines])
        works = [broadcast_async(t, src=0, group=self.group) for t in tensors]
        self._dist_sequence += 1
        self._in_flight.append((calls, works, time.monotonic() + self.timeout_s))

    def _finish_distributed(self, keep_last: bool = False) -> None:
        """Wait for the buckets sent: every broadcast received, then every engine's answer (`keep_last`: all
        but the last bucket's, which may still be copied). An engine that refuses a bucket while a broadcast
        is pending, or a broadcast still pending after the timeout, aborts the group everywhere; the next
        sync forms it again."""
        flights = self._in_flight
        if not flights:
            return
        while not all(w.is_completed() for _, works, _ in flights for w in works):
            refused = next((c.first_error() for c, _, _ in flights if c.first_error() is not None), None)
            late = any(time.monotonic() > deadline and not all(w.is_completed() for w in works)
                       for _, works, deadline in flights)
            if refused is not None or late:
                self._in_flight = []
                self._drop_group(aborted=True)
                for calls, _, _ in flights:
                    calls.wait(30)
                if refused is None:
                    pending = [u for c, _, _ in flights for u in c.pending_urls()]
                    raise WeightSyncError(f"weight broadcast not received by every engine within {self.timeout_s:.0f} s "
                                          f"(--update-weight-timeout); pending engines: {pending}; "
                                          "the weight-update group was aborted and is formed again at the next sync")
                raise WeightSyncError(f"{str(refused).splitlines()[0]}; the weight-update group was aborted on every "
                                      "engine and is formed again at the next sync") from None
            time.sleep(0.001)
        for _, works, _ in flights:
            for w in works:
                w.wait()
        answered = flights[:-1] if keep_last else flights
        self._in_flight = flights[len(answered):]
        error = None
        for calls, _, _ in answered:
            error = error or calls.wait(self.timeout_s).first_error()
        if error is not None:  # every answer is in before the sync fails
            for calls, _, _ in self._in_flight:
                calls.wait(self.timeout_s)
            self._in_flight = []
            raise error

    def serves_checksums(self, engine: EngineEndpoint) -> bool:
        """Whether the engine advertises `/get_weights_checksum` (`"weights_checksum": true` in
        `/get_model_info`); asked once per engine, and a missing answer counts as no (logged once)."""
        known = self._checksum_support.get(engine.url)
        if known is not None:
            return known
        info = self.engine_info(engine)
        if "_error" in info:
            supported, why = False, f"/get_model_info failed ({info['_error']})"
        else:
            supported, why = info.get("weights_checksum") is True, \
                "its /get_model_info does not advertise weights_checksum (SGLang has no /get_weights_checksum)"
        if not supported:
            logger.warning("weight sync check skipped for engine %s: %s; the sync itself is unchecked", engine.url, why)
        self._checksum_support[engine.url] = supported
        return supported

    def verify(self, expected: dict[str, list[float]]) -> int:
        """Compare the checksums of the synced names on every engine that serves them with the trainer's;
        raise on a mismatch. Returns the number of tensors checked (0 when no engine could be checked)."""
        names = sorted(expected)
        checked = 0
        for engine in self.engines:
            if not self.serves_checksums(engine):
                continue
            actual = self._reported.get(engine.url, {})
            if not set(names) <= actual.keys():  # not reported with the updates: ask
                reply = self.post(engine, "/get_weights_checksum", {"names": names})
                actual = reply.get("checksums", {}) if isinstance(reply, dict) else {}
            bad = weight_checksum.mismatches(expected, {n: actual[n] for n in names if n in actual})
            if bad:
                raise WeightSyncError(
                    f"weight sync {self.syncs}: engine {engine.url} differs from the trainer in {len(bad)} tensors "
                    f"(first: {bad[:3]}); stopping (the engine would sample from the wrong policy)")
            logger.info("weight sync %d: %d tensors verified on %s", self.syncs, len(names), engine.url)
            checked = len(names)
        return checked


class _WeightSetSync:
    """One sync through an engine's weight sets, with the shared-bucket sender's interface (add, finish): every
    tensor is copied into the engine's target set; `finish` commits the update (the engine checks it in full,
    against the written bytes' checksums when the sync is checked, then switches to it). A failure keeps the
    export going (its collectives) and writes nothing more; no commit, so the engine keeps its weights."""

    reuse = True

    def __init__(self, ws: WeightSync, engine: EngineEndpoint, writer, version: int) -> None:
        self.ws, self.engine, self.writer, self.version = ws, engine, writer, version
        self.error: BaseException | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            self.writer.add(name, t)
        except Exception as e:  # noqa: BLE001 - raised by finish(), after the export has run to its end
            self.error = WeightSyncError(f"weight sync to {self.engine.url}: {_line(e)}; the engine keeps its weights")

    def finish(self) -> dict[str, list[int]]:
        if self.error is not None:
            raise self.error
        if not self.writer.names:
            return {}
        check = self.ws.check and self.ws.role.sender
        self.writer.flush()
        get_accelerator().synchronize()  # the copies are complete before the engine switches to them
        expected = weight_checksum.named_checksums(self.writer.written()) if check else {}
        body: dict[str, Any] = {"layout_id": self.writer.layout_id, "epoch": self.writer.epoch,
                                "names": self.writer.names, "weight_version": str(self.version)}
        if check:
            body.update(checksums=expected, return_checksums=True)
        reply = self.ws.post(self.engine, "/commit_weight_sets", body)
        _check_reply(reply, f"commit_weight_sets ({self.engine.url})")
        if check and isinstance(reply.get("checksums"), dict):
            self.ws._reported.setdefault(self.engine.url, {}).update(reply["checksums"])
        return expected


class _EngineCalls:
    """HTTP calls to several engines on their own threads; errors are kept (first one raised on demand)."""

    def __init__(self, ws: WeightSync, calls: list[tuple], fn: Callable[..., None] | None = None) -> None:
        self.errors: list[BaseException] = []
        self.threads: dict[str, threading.Thread] = {}

        def run(engine: EngineEndpoint, path: str | None, arg: Any) -> None:
            try:
                if fn is not None:
                    fn(arg, engine)
                else:
                    _check_reply(ws.post(engine, path, arg), f"{path.lstrip('/')} ({engine.url})")
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

    def wait(self, timeout: float | None) -> "_EngineCalls":
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads.values():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

def engines_load_mtp(args) -> bool:
    """Whether the engines hold the checkpoint's MTP layers: SGLang loads them only as the draft model of
    speculative decoding (--sglang-speculative-algorithm, e.g. EAGLE in upstream's GLM-5 and MiMo scripts); the
    embedded engine (transformers' model) has none and ignores the speculative options."""
    if not args.sglang_speculative_algorithm:
        return False
    from slime.ray.rollout_manager import resolve_engine_kind

    return resolve_engine_kind(args) == "sglang"


def without_mtp_layers(buckets, arch):
    """The exported buckets minus the MTP layers' tensors (model.layers.{N + k}.*); empty buckets dropped.
    Every rank of a stage exports the same names, so all drop alike."""
    from slime_plugins.models.common.weights import is_mtp_name

    for bucket in buckets:
        kept = [(n, t) for n, t in bucket if not is_mtp_name(arch, n)]
        if kept:
            yield kept


def create_weight_sync(args, model, engines: list[dict[str, Any]], rank: int) -> WeightSync:
    from slime.backends.megatron import model_setup

    acc = get_accelerator()
    mode = resolve_mode(args.update_weight_mode, args.colocate, acc.capabilities.ipc)
    endpoints = [EngineEndpoint.from_dict(e) for e in engines]
    timeout = float(args.update_weight_timeout)
    world, exchange = 1, None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from slime.utils.distributed import default_store

        world = dist.get_world_size()
        exchange = PayloadExchange(default_store(), rank, timeout) if mode == "ipc" and world > 1 else None

    from slime.backends.megatron.hf_export import unwrap

    arch = unwrap(model).arch
    keep_mtp = engines_load_mtp(args)

    def export():
        buckets = model_setup.export_hf(model, args.update_weight_buffer_size)
        return buckets if keep_mtp else without_mtp_layers(buckets, arch)

    return WeightSync(mode, export, endpoints, rank, check=bool(args.check_weight_sync),
                      buffer_bytes=args.update_weight_buffer_size, world_size=world, timeout_s=timeout,
                      exchange=exchange, role=stage_role(rank))


def stage_role(rank: int) -> StageRole:
    """This rank's StageRole from megatron's parallel state: one sender per pipeline stage (with pp = 1, rank 0
    alone, with no extra collectives)."""
    from megatron.core import parallel_state as ps

    stages = ps.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return StageRole(sender=rank == 0)
    import torch.distributed as dist

    from slime.backends.megatron.hf_export import writer_of_stage

    def gather(obj):
        out = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    return StageRole(stage=ps.get_pipeline_model_parallel_rank(), stages=stages, sender=writer_of_stage(),
                     barrier=dist.barrier, gather=gather)
