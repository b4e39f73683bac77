"""The weight sync's one sequence, whatever the transport: pause the engines, stage every exported bucket
through the transport, gather every pipeline stage's outcome, then flush the engines' caches and let them
generate again, and verify their weights against the trainer's; all or nothing.

Pipeline parallel: every stage exports its own layers, and one rank per stage (TP/EP/DP rank 0 of the
stage) sends them through its own transport. Trainer rank 0 pauses the engines before any stage sends,
collects every stage's checksums, byte counts and errors, then flushes, resumes and verifies them all: the
engines receive each tensor of the model once per sync, and the check covers every stage. A failure in any
stage stops every transport from sending more (the export still drains: its collectives), and whatever
fails, every engine is asked to flush its cache (retried while it is busy) and to continue generating
before `sync` returns or raises.

After every sync the engine's weight checksums (`/get_weights_checksum`) must equal the trainer's
exported weights (for ipc: computed on the shared buffers the engines read); a mismatch raises
`WeightSyncError`. That endpoint is slime's extension: an engine serves it when its `/get_model_info`
says `"weights_checksum": true` (the embedded engine); for any other engine (SGLang) the check is skipped
with one log line per engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron.weight_sync.broadcast import BroadcastTransport
from slime.backends.megatron.weight_sync.common import (EngineEndpoint, StageRole, SyncRound, WeightSyncError,
                                                        check_reply, default_get, default_post, first_line)
from slime.backends.megatron.weight_sync.disk import DiskTransport
from slime.backends.megatron.weight_sync.tensor_handles import PayloadExchange, TensorHandleTransport
from slime.backends.megatron.weight_sync.weight_sets import WeightSetTransport
from slime.utils import weight_checksum
from slime.utils.net import node_ip

logger = logging.getLogger(__name__)


@dataclass
class _SyncTimes:
    """Where one sync's seconds went (the split of time/weight_sync, see WeightSync.sync)."""

    start: float = field(default_factory=time.perf_counter)
    export: float = 0.0  # export started
    wait: float = 0.0  # export done, waiting for the engines
    done: float = 0.0  # every transport finished
    control: float = 0.0  # pause, flush, continue
    verify: float = 0.0

    def __post_init__(self) -> None:
        self.export = self.wait = self.done = self.start


@dataclass
class _Outcome:
    """What a rank (rank 0: every stage together) staged in one sync."""

    sent_bytes: int = 0
    expected: dict[str, list[int]] = field(default_factory=dict)  # name -> the trainer's checksum
    error: BaseException | None = None


class WeightSync:
    """Runs on every trainer rank (export is collective); rank 0 talks to the engines.

    mode "ipc" (colocated): through the engine's weight sets where one embedded engine offers them
    (weight_sets.py), else through shared buffers and tensor handles (tensor_handles.py); mode "distributed":
    broadcast over a collective group (broadcast.py); mode "disk": a checkpoint under `disk_dir` the engines
    load (disk.py)."""

    def __init__(self, mode: str, export: Callable[[], Iterable[list[tuple[str, torch.Tensor]]]],
                 engines: list[EngineEndpoint], rank: int, check: bool = True,
                 post: Callable[..., dict[str, Any]] = default_post,
                 get: Callable[..., dict[str, Any]] = default_get, buffer_bytes: int = 64 << 20,
                 world_size: int = 1, timeout_s: float = 600.0, exchange: PayloadExchange | None = None,
                 role: StageRole | None = None, expert_layout: str = "in_out",
                 host: Callable[[], str] = node_ip, disk_dir: str | None = None,
                 disk_keep_files: bool = False) -> None:
        self.mode, self.export, self.engines, self.rank = mode, export, engines, rank
        self.role = role or StageRole(sender=rank == 0)
        self.controller = rank == 0  # pauses, resumes and verifies the engines
        self.check, self.post, self.get = check, post, get
        self.world_size, self.timeout_s = world_size, timeout_s
        self.syncs = 0
        self._checksum_support: dict[str, bool] = {}  # per engine url: serves /get_weights_checksum
        self._info: dict[str, dict[str, Any]] = {}  # per engine url: its /get_model_info (asked once)
        self._reported: dict[str, dict[str, list[int]]] = {}  # last sync: checksums engines sent with updates
        self.last_split: dict[str, float] = {}  # seconds of the last sync's parts (see sync)
        self.tensor_handles = TensorHandleTransport(self, buffer_bytes, exchange)
        self.weight_sets = WeightSetTransport(self, expert_layout)
        self.broadcast = BroadcastTransport(self, host)
        self.disk = DiskTransport(self, disk_dir, disk_keep_files)

    @property
    def group(self) -> Any:
        """distributed: the weight-update group with the engines (None until formed, and after an abort)."""
        return self.broadcast.group

    @group.setter
    def group(self, group: Any) -> None:
        self.broadcast.group = group

    # --- set-up ---------------------------------------------------------------------------
    def connect(self) -> None:
        """distributed: form the weight-update group with every engine (each stage's sender)."""
        if self.mode == "distributed" and self.role.sender:
            self.broadcast.connect()

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
            self.broadcast.drop_group()
        self.engines = list(engines)
        for e in engines:
            if (e.url, e.instance) not in old:
                self._checksum_support.pop(e.url, None)
                self._info.pop(e.url, None)
        if regroup:
            self.connect()
        return True

    def close(self) -> None:
        self.weight_sets.close()
        self.tensor_handles.close()
        self.broadcast.close()
        self.disk.close()

    # --- what the engines offer ---------------------------------------------------------------
    def engine_info(self, engine: EngineEndpoint) -> dict[str, Any]:
        """The engine's /get_model_info (asked once per engine process); {} when it cannot be read."""
        info = self._info.get(engine.url)
        if info is None:
            try:
                info = self.get(engine, "/get_model_info")
                info = info if isinstance(info, dict) else {}
            except Exception as e:
                info = {"_error": first_line(e)}
            self._info[engine.url] = info
        return info

    def takes_weight_sets(self, engine: EngineEndpoint) -> bool:
        """Whether the engine's weights can live in weight sets this trainer writes (`"weight_sets"` in its
        /get_model_info lists this export's expert layout: the embedded engine in one process on host memory)."""
        return self.weight_sets.offered_by(self.engine_info(engine))

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

    # --- one sync -------------------------------------------------------------------------
    def sync(self, version: int, engines: list[EngineEndpoint] | None = None) -> dict[str, float]:
        """Push the current weights to every engine (`engines`: the manager's current list, see
        `set_engines`); returns timing/size metrics: time/weight_sync and its split into
        time/weight_sync_export (export and packing on this thread, which the posts overlap),
        time/weight_sync_wait (waiting for the engines after the export), time/weight_sync_control
        (pause/flush/continue) and time/weight_sync_verify (engine checksums and the comparison).
        With --check-weight-sync, engines that can answer an update with the checksums of the weights it
        changed (`"update_checksums": true`) are asked to; others are asked with /get_weights_checksum.
        A failure anywhere still drains the export (its collectives) and resumes every engine, then raises."""
        times = _SyncTimes()
        if engines is not None:
            self.set_engines(engines)
        rnd = SyncRound(version)
        self._pause(rnd, times)
        self.role.barrier()  # every stage sends only once the engines are paused
        outcome = self._stage(rnd, times)
        outcome = self._gather(rnd, outcome)
        if self.mode == "disk" and self.controller:  # every stage has written its files, or failed
            try:
                self.disk.conclude(rnd, outcome.error)
            except BaseException as e:  # noqa: BLE001 - raised by _resume, after every engine is resumed
                outcome.error = outcome.error or e
        self._resume(outcome.error, times)
        metrics = {"weight_sync/bytes": float(outcome.sent_bytes)}
        if self.controller and self.check:
            t_verify = time.perf_counter()
            metrics["weight_sync/checked_tensors"] = float(self.verify(outcome.expected))
            times.verify = time.perf_counter() - t_verify
        self.syncs += 1
        metrics.update({"time/weight_sync": time.perf_counter() - times.start,
                        "time/weight_sync_export": times.wait - times.export,
                        "time/weight_sync_wait": times.done - times.wait,
                        "time/weight_sync_control": times.control, "time/weight_sync_verify": times.verify})
        self.last_split = {k: v for k, v in metrics.items() if k.startswith("time/")}
        return metrics

    def _pause(self, rnd: SyncRound, times: _SyncTimes) -> None:
        """Rank 0 pauses generation on every engine (the cache is flushed once, after the update, before
        generation continues). A failure is the round's: no transport sends, the other ranks still meet at
        the barrier and the gather."""
        if not self.controller:
            return
        t0 = time.perf_counter()
        try:
            for engine in self.engines:
                check_reply(self.post(engine, "/pause_generation", {}), "/pause_generation")
            if self.mode == "disk":  # before any stage writes (they start after the barrier)
                self.disk.prepare(rnd)
        except BaseException as e:  # noqa: BLE001 - raised after the gather
            rnd.fail(e)
        times.control += time.perf_counter() - t0

    def _begin_stage(self, rnd: SyncRound):
        """This rank's transport for this sync, begun; None when it sends nothing (a distributed non-sender,
        an ipc rank colocated with no engine rank)."""
        if self.mode == "distributed":
            return self.broadcast.begin(rnd) if self.role.sender else None
        if self.mode == "disk":
            return self.disk.begin(rnd) if self.role.sender else None
        if not (self.role.sender or self.tensor_handles.feeds(self.rank)):
            return None
        engine = self._weight_set_engine()
        if engine is not None:
            return self.weight_sets.begin(rnd, engine)
        return self.tensor_handles.begin(rnd)

    def _weight_set_engine(self) -> EngineEndpoint | None:
        """The engine to sync through weight sets: one engine of one process fed by this rank alone (pipeline
        stage 1 of 1), on host memory, that offers them; else None (shared buckets)."""
        if (not self.role.sender or self.role.stages != 1 or len(self.engines) != 1
                or not get_accelerator().memory_is_host()):
            return None
        engine = self.engines[0]
        if engine.tp_size != 1 or self.tensor_handles.feeds(self.rank) != [(0, 0)] or not self.takes_weight_sets(engine):
            return None
        return engine

    def _stage(self, rnd: SyncRound, times: _SyncTimes) -> _Outcome:
        """Every exported bucket through this rank's transport; the export runs to its end whatever fails."""
        out, stage = _Outcome(), None
        try:
            stage = self._begin_stage(rnd)
            times.export = time.perf_counter()
            for bucket in self.export():
                if stage is not None:
                    out.sent_bytes += stage.add(bucket)
                del bucket
            times.wait = time.perf_counter()
            if stage is not None:
                out.expected = stage.finish()
            if rnd.failed is not None:
                raise rnd.failed
            times.done = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - gathered, so every rank ends the same way
            out.error = rnd.failed or e
            if stage is not None:
                stage.abandon()
        if not self.role.sender:
            out.expected = {}
        return out

    def _gather(self, rnd: SyncRound, out: _Outcome) -> _Outcome:
        """Rank 0 takes every stage's tensors, checksums, engine replies and errors."""
        parts = self.role.gather((out.sent_bytes, out.expected, rnd.reported,
                                  None if out.error is None else first_line(out.error)))
        self._reported = rnd.reported
        if not (self.controller and parts):
            return out
        total, self._reported = _Outcome(error=out.error), {}
        for part_bytes, part_expected, part_reported, part_error in parts:
            total.sent_bytes += part_bytes
            total.expected.update(part_expected)
            for url, sums in part_reported.items():
                self._reported.setdefault(url, {}).update(sums)
            if total.error is None and part_error is not None:
                total.error = WeightSyncError(part_error)
        return total

    def _resume(self, error: BaseException | None, times: _SyncTimes) -> None:
        """Rank 0 flushes every engine's cache (retried while it is busy) and lets it generate again, also after
        a failure (every engine is asked even when another fails); then the first failure is raised."""
        try:
            if error is not None:
                raise error
        finally:
            if self.controller:
                t0 = time.perf_counter()
                try:
                    self._resume_all()
                finally:
                    times.control += time.perf_counter() - t0

    def _resume_all(self) -> None:
        errors: list[BaseException] = []
        for engine in self.engines:
            for step in (self._flush_cache, self._continue):
                try:
                    step(engine)
                except Exception as e:  # noqa: BLE001 - reported after every engine was asked
                    errors.append(e)
        if errors:
            raise errors[0]

    def _continue(self, engine: EngineEndpoint) -> None:
        check_reply(self.post(engine, "/continue_generation", {}, timeout=60), "/continue_generation")

    def _flush_cache(self, engine: EngineEndpoint, budget_s: float = 60.0) -> None:
        """SGLang answers /flush_cache with a non-200 while requests are in flight: retry until idle (bounded)."""
        deadline = time.monotonic() + budget_s
        while True:
            try:
                check_reply(self.post(engine, "/flush_cache", {}, timeout=30), "/flush_cache")
                return
            except WeightSyncError as e:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{engine.url}/flush_cache still refused after {budget_s:.0f} s: "
                                          f"{str(e).splitlines()[0]}") from None
                time.sleep(0.2)

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
