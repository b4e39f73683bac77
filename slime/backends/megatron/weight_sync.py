"""Trainer -> rollout engine weight sync, through the accelerator, over SGLang's HTTP protocol.

ipc (colocated): the tensors of `export_hf` are copied once into flat per-dtype buffers shared with
the engines (`shared_buckets.SharedBucketSender`: two sets, reused, one posted to
`/update_weights_from_tensor` while the export fills the other); the engine opens the handles (no copy
across the process boundary) and copies into its weights. Engines advertising `"flattened_bucket": true`
get one handle per buffer (`load_format: "flattened_bucket"`); others (SGLang) get per-tensor handles
of views into buffers that are not reused. Generation is paused and the cache flushed around the update.

distributed: trainer rank 0 and every engine device form one collective group on the accelerator's
backend (`/init_weights_update_group`); per bucket, names/dtypes/shapes go over HTTP
(`/update_weights_from_distributed`) while rank 0 broadcasts the tensors.

Pipeline parallel: every stage exports its own layers, and one rank per stage (TP/EP/DP rank 0 of the
stage) sends them: its own shared buffers (ipc), or its own collective group with the engines, named per
stage (distributed). Trainer rank 0 pauses the engines before any stage sends, collects every stage's
checksums and byte counts, then flushes, resumes and verifies them all: the engines receive each tensor
of the model once per sync, and the check covers every stage.

auto: ipc when colocated and the device supports IPC, else distributed (logged once).
After every sync the engine's weight checksums (`/get_weights_checksum`) must equal the trainer's
exported weights (for ipc: computed on the shared buffers the engines read); a mismatch raises
`WeightSyncError`. That endpoint is slime's extension: an engine
serves it when its `/get_model_info` says `"weights_checksum": true` (the embedded engine); for any
other engine (SGLang) the check is skipped with one log line per engine.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from slime.accelerator import get_accelerator
from slime.utils import weight_checksum

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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineEndpoint":
        return cls(url=str(d["url"]).rstrip("/"), tp_size=int(d.get("tp_size", 1)), token=d.get("token"),
                   instance=int(d.get("instance", 0)))


def default_post(endpoint: EngineEndpoint, path: str, payload: dict[str, Any] | None,
                 timeout: float = 600.0) -> dict[str, Any]:
    """POST JSON to an engine; returns the decoded body, raises WeightSyncError on a non-2xx reply."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if endpoint.token:
        headers["Authorization"] = f"Bearer {endpoint.token}"
    req = urllib.request.Request(endpoint.url + path, data=json.dumps(payload or {}).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise WeightSyncError(f"{endpoint.url}{path} answered HTTP {e.code}: {detail}") from None
    return json.loads(body) if body else {}


def default_get(endpoint: EngineEndpoint, path: str, timeout: float = 60.0) -> dict[str, Any]:
    """GET JSON from an engine; returns the decoded body, raises WeightSyncError on a non-2xx reply."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
    req = urllib.request.Request(endpoint.url + path, headers=headers, method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise WeightSyncError(f"{endpoint.url}{path} answered HTTP {e.code}") from None
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


def _check_reply(reply: dict[str, Any], what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightSyncError(f"engine refused {what}: {reply.get('message', reply)}")


class WeightSync:
    """Runs on every trainer rank (export is collective); rank 0 talks to the engines."""

    def __init__(self, mode: str, export: Callable[[], Iterable[list[tuple[str, torch.Tensor]]]],
                 engines: list[EngineEndpoint], rank: int, check: bool = True,
                 post: Callable[..., dict[str, Any]] = default_post,
                 get: Callable[..., dict[str, Any]] = default_get, buffer_bytes: int = 64 << 20,
                 role: StageRole | None = None) -> None:
        self.mode, self.export, self.engines, self.rank = mode, export, engines, rank
        self.role = role or StageRole(sender=rank == 0)
        self.controller = rank == 0  # pauses, resumes and verifies the engines
        self.check, self.post, self.get = check, post, get
        self.buffer_bytes = buffer_bytes  # ipc: capacity of each shared per-dtype buffer
        self.group = None
        self.syncs = 0
        self._checksum_support: dict[str, bool] = {}  # per engine url: serves /get_weights_checksum
        self._info: dict[str, dict[str, Any]] = {}  # per engine url: its /get_model_info (asked once)
        self._reported: dict[str, dict[str, list[int]]] = {}  # this sync: checksums engines sent with updates
        self._sender = None  # ipc: SharedBucketSender, kept across syncs while the engines take flat buffers
        self.last_split: dict[str, float] = {}  # seconds of the last sync's parts (see sync)

    # --- set-up ---------------------------------------------------------------------------
    def connect(self) -> None:
        if self.mode != "distributed" or not self.role.sender:
            return
        from slime.backends.megatron.actor import _node_ip
        from slime.utils.net import free_port
        from slime.utils.distributed import init_custom_process_group

        addr, port = _node_ip(), free_port("")
        world = 1 + sum(e.tp_size for e in self.engines)
        backend = get_accelerator().process_group_backend()
        errors: list[BaseException] = []

        def ask(engine: EngineEndpoint, offset: int) -> None:
            try:
                _check_reply(self.post(engine, "/init_weights_update_group", {
                    "master_address": addr, "master_port": port, "rank_offset": offset, "world_size": world,
                    "group_name": self.role.group_name, "backend": backend}), "init_weights_update_group")
            except BaseException as e:  # reported after the group forms or times out
                errors.append(e)

        threads, offset = [], 1
        for engine in self.engines:
            threads.append(threading.Thread(target=ask, args=(engine, offset), daemon=True))
            offset += engine.tp_size
        for t in threads:
            t.start()
        self.group = init_custom_process_group(addr, port, world_size=world, rank=0,
                                               group_name=self.role.group_name, backend=backend)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

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
            self.close()
        self.engines = list(engines)
        for e in engines:
            if (e.url, e.instance) not in old:
                self._checksum_support.pop(e.url, None)
                self._info.pop(e.url, None)
        if regroup:
            self.connect()
        return True

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self.group is not None and self.role.sender:
            for engine in self.engines:
                try:
                    self.post(engine, "/destroy_weights_update_group", {"group_name": self.role.group_name},
                              timeout=30)
                except Exception:
                    pass
            from slime.utils.distributed import destroy_custom_process_group

            destroy_custom_process_group(self.group)
            self.group = None

    # --- one sync -------------------------------------------------------------------------
    def _all_engines(self, path: str, payload: dict[str, Any]) -> None:
        for engine in self.engines:
            _check_reply(self.post(engine, path, payload), path)

    def sync(self, version: int, engines: list[EngineEndpoint] | None = None) -> dict[str, float]:
        """Push the current weights to every engine (`engines`: the manager's current list, see
        `set_engines`); returns timing/size metrics: time/weight_sync and its split into
        time/weight_sync_export (export and packing on this thread, which the posts overlap),
        time/weight_sync_wait (waiting for the engines after the export), time/weight_sync_control
        (pause/flush/continue) and time/weight_sync_verify (engine checksums and the comparison).
        With --check-weight-sync, engines that can answer an update with the checksums of the weights it
        changed (`"update_checksums": true`) are asked to; others are asked with /get_weights_checksum."""
        t0 = time.perf_counter()
        leader = self.role.sender
        if engines is not None:
            self.set_engines(engines)
        sent_bytes, expected = 0, {}
        control = 0.0
        self._reported = {}
        if self.controller:  # (the cache is flushed once, after the update, before generation continues)
            control = self._timed(lambda: self._all_engines("/pause_generation", {}))
        self.role.barrier()  # every stage sends only once the engines are paused
        sender = self._ipc_sender(version) if leader and self.mode == "ipc" else None
        t_export = time.perf_counter()
        for bucket in self.export():
            if not leader:
                continue  # other ranks only take part in the export's collectives
            sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if sender is not None:
                for name, t in bucket:
                    sender.add(name, t)
            else:
                if self.check:
                    expected.update(weight_checksum.named_checksums(bucket))
                self._send_distributed(bucket, version)
            del bucket
        t_wait = time.perf_counter()
        if sender is not None:
            try:
                expected = sender.finish()
            finally:
                if not sender.reuse:
                    sender.close()
                    self._sender = None
        t_done = time.perf_counter()
        parts = self.role.gather((sent_bytes, expected if leader else {}, self._reported))
        if self.controller:  # every stage's tensors, checksums and engine replies
            sent_bytes, expected, self._reported = 0, {}, {}
            for part_bytes, part_expected, part_reported in parts:
                sent_bytes += part_bytes
                expected.update(part_expected)
                for url, sums in part_reported.items():
                    self._reported.setdefault(url, {}).update(sums)
        metrics = {"weight_sync/bytes": float(sent_bytes)}
        verify = 0.0
        if self.controller:
            control += self._timed(lambda: (self._all_engines("/flush_cache", {}),
                                            self._all_engines("/continue_generation", {})))
            if self.check:
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
        """Whether the engine takes slime's flattened_bucket layout and has read the buffers when it replies."""
        return self.engine_info(engine).get("flattened_bucket") is True

    def _ipc_sender(self, version: int):
        """The shared-buffer sender for this sync: reused across syncs while every engine takes flat buffers
        (the embedded engine); a fresh one, not reusing buffers, when any engine wants per-tensor handles."""
        from slime.backends.megatron.shared_buckets import SharedBucketSender

        acc = get_accelerator()
        flat = {e.url: self.takes_flat_buffers(e) for e in self.engines}
        reuse = all(flat.values())
        if self._sender is None or self._sender.reuse != reuse:
            if self._sender is not None:
                self._sender.close()
            share = acc.reduce_tensor if acc.device_type == "cpu" else None  # into shared memory once, at allocation
            self._sender = SharedBucketSender(self.buffer_bytes, acc.device(), self._post_packed, reuse=reuse,
                                              share=share)
        self._sender.checksums = self.check
        self._version, self._flat_engines = version, flat
        return self._sender

    def _post_packed(self, packed) -> None:
        """Post one packed set to every engine (called from the sender's worker thread)."""
        acc = get_accelerator()

        def post(engine: EngineEndpoint) -> None:
            body: dict[str, Any] = {"flush_cache": False, "weight_version": str(self._version)}
            if self.check and self.engine_info(engine).get("update_checksums") is True:
                body["return_checksums"] = True
            if self._flat_engines.get(engine.url):
                payloads, meta = zip(*(packed.flattened_payload(acc) for _ in range(engine.tp_size)))
                body.update(serialized_named_tensors=list(payloads), load_format="flattened_bucket",
                            flattened_bucket_meta=meta[0])
            else:  # one serialization per receiving process (see PackedSend)
                body.update(serialized_named_tensors=[packed.per_tensor_payload(acc) for _ in range(engine.tp_size)],
                            load_format=None)
            reply = self.post(engine, "/update_weights_from_tensor", body)
            _check_reply(reply, "update_weights_from_tensor")
            if body.get("return_checksums") and isinstance(reply, dict) and isinstance(reply.get("checksums"), dict):
                self._reported.setdefault(engine.url, {}).update(reply["checksums"])

        if len(self.engines) == 1:
            post(self.engines[0])
            return
        errors: list[BaseException] = []

        def guarded(engine: EngineEndpoint) -> None:
            try:
                post(engine)
            except BaseException as e:  # reported once every engine has answered
                errors.append(e)

        threads = [threading.Thread(target=guarded, args=(e,), daemon=True) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _send_distributed(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        from slime.utils.distributed import broadcast

        device = get_accelerator().device()
        tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                   "shapes": [list(t.shape) for t in tensors], "group_name": self.role.group_name, "flush_cache": False,
                   "weight_version": str(version)}
        errors: list[BaseException] = []

        def ask(engine: EngineEndpoint) -> None:
            try:
                _check_reply(self.post(engine, "/update_weights_from_distributed", payload),
                             "update_weights_from_distributed")
            except BaseException as e:
                errors.append(e)

        # The engines block in the broadcast until rank 0 sends, so their HTTP calls run alongside.
        threads = [threading.Thread(target=ask, args=(e,), daemon=True) for e in self.engines]
        for t in threads:
            t.start()
        for t in tensors:
            broadcast(t, src=0, group=self.group)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

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


def create_weight_sync(args, model, engines: list[dict[str, Any]], rank: int) -> WeightSync:
    from slime.backends.megatron import model_setup

    acc = get_accelerator()
    mode = resolve_mode(args.update_weight_mode, args.colocate, acc.capabilities.ipc)
    endpoints = [EngineEndpoint.from_dict(e) for e in engines]

    def export():
        return model_setup.export_hf(model, args.update_weight_buffer_size)

    return WeightSync(mode, export, endpoints, rank, check=bool(args.check_weight_sync),
                      buffer_bytes=args.update_weight_buffer_size, role=stage_role(rank))


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
