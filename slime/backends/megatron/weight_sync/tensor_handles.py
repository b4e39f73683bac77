"""Colocated transport through tensor handles: SGLang's `/update_weights_from_tensor` with
`load_format: "flattened_bucket"` (upstream's update_weight_from_tensor.py).

The tensors of the export are copied once into flat uint8 buffers shared with the engines
(`shared_buckets.SharedBucketSender`: two sets, one posted while the export fills the other). Each post
carries one payload per engine TP rank (slime.utils.tensor_bucket): payload j holds the buffer of the
trainer rank colocated with the engine's TP rank j (its `trainer_ranks`), so every engine rank maps memory
on its own device. Every such trainer rank packs the same export; rank 0 collects the others' payloads for
each flush through the default group's store (`PayloadExchange`), posts, and hands the verdict back, so all
ranks end a sync with the same outcome. Under pipeline parallel each stage's sender feeds every engine rank
with its stage's tensors.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron.weight_sync.common import (EngineCalls, EngineEndpoint, SyncRound, WeightSyncError,
                                                        check_reply, first_line)
from slime.backends.megatron.weight_sync.shared_buckets import PackedSend, SharedBucketSender


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
        base = f"{self.prefix}/{flush[0]}/{flush[1]}"
        self.store.set(f"{base}/payload/{self.rank}", json.dumps(payloads))
        return self._take(f"{base}/verdict/{self.rank}", f"rank 0's answer to flush {flush[1]}")

    def collect(self, flush: tuple[int, int], ranks: list[int]) -> dict[str, str]:
        base, out = f"{self.prefix}/{flush[0]}/{flush[1]}", {}
        for r in ranks:
            out.update(json.loads(self._take(f"{base}/payload/{r}", f"trainer rank {r}'s payload of flush {flush[1]}")))
        return out

    def answer(self, flush: tuple[int, int], ranks: list[int], verdict: str) -> None:
        base = f"{self.prefix}/{flush[0]}/{flush[1]}"
        for r in ranks:
            self.store.set(f"{base}/verdict/{r}", verdict)


class TensorHandleTransport:
    """The shared-buffer sender of every sync of one WeightSync, and its posts. `ctx` is the controller
    (slime.backends.megatron.weight_sync.controller.WeightSync): engines, post, role, rank, world size, check,
    sync count and the engines' /get_model_info."""

    def __init__(self, ctx: Any, buffer_bytes: int, exchange: PayloadExchange | None) -> None:
        self.ctx = ctx
        self.buffer_bytes = buffer_bytes  # capacity of each shared buffer
        self.exchange = exchange  # with other feeding ranks: how their payloads reach rank 0
        self.sender: SharedBucketSender | None = None  # kept across syncs while the engines take flat buffers
        self.round: SyncRound | None = None

    def takes_flat_buffers(self, engine: EngineEndpoint) -> bool:
        """Whether the engine has read the shared buffers when it replies (`"flattened_bucket": true`), so they
        can be refilled; SGLang engines get new buffers for every flush."""
        return self.ctx.engine_info(engine).get("flattened_bucket") is True

    def feeds(self, rank: int) -> list[tuple[int, int]]:
        """(engine index, engine TP rank) pairs whose payload trainer rank `rank` provides."""
        ctx = self.ctx
        pairs = [(i, j) for i, e in enumerate(ctx.engines) for j in range(e.tp_size)]
        if ctx.role.stages > 1:
            return pairs if rank == ctx.rank and ctx.role.sender else []
        return [(i, j) for i, j in pairs if ctx.engines[i].feeder(j, ctx.world_size) == rank]

    def begin(self, rnd: SyncRound) -> "TensorHandleStage":
        """This sync's sender: reused across flushes and syncs when every engine has read the buffers when it
        replies; a fresh one, not reusing buffers, otherwise. On a synchronized device (CPU) every engine has:
        its copies are complete when they return, SGLang's CPU backend's too. On a GPU/NPU SGLang replies with
        its copies possibly still queued on its stream, so only engines that synchronize before replying
        (`"flattened_bucket": true`, the embedded engine) get refilled buffers there."""
        acc = get_accelerator()
        reuse = acc.is_synchronized_device() or all(self.takes_flat_buffers(e) for e in self.ctx.engines)
        if self.sender is None or self.sender.reuse != reuse:
            if self.sender is not None:
                self.sender.close()
            share = acc.reduce_tensor if acc.memory_is_host() else None  # into shared memory once, at allocation
            self.sender = SharedBucketSender(self.buffer_bytes, acc.device(), self._post_packed, reuse=reuse,
                                             share=share)
        self.sender.checksums = self.ctx.check and self.ctx.role.sender
        self.sender.flushes = 0  # flush numbers key the payload exchange: the same on every rank
        self.round = rnd
        return TensorHandleStage(self, self.sender)

    def _post_packed(self, packed: PackedSend) -> None:
        """One flush (on the sender's worker thread): this rank's payloads for the engine TP ranks it feeds;
        rank 0 adds the other ranks' (PayloadExchange) and posts every engine its list, one per TP rank."""
        ctx, rnd = self.ctx, self.round
        flush = (ctx.syncs, packed.index)
        mine = {f"{i}/{j}": packed.flattened_payload(get_accelerator()) for i, j in self.feeds(ctx.rank)}
        if not ctx.role.sender:
            verdict = self.exchange.send_payloads(flush, mine) if self.exchange is not None else ""
            if verdict:
                raise WeightSyncError(verdict)
            return
        others = sorted({r for r in range(ctx.world_size) if r != ctx.rank and self.feeds(r)})
        if others and self.exchange is None:
            raise WeightSyncError("engines are colocated with trainer ranks other than 0 but no payload exchange is "
                                  "set up (create_weight_sync sets one when torch.distributed is initialized)")
        try:
            payloads = {**mine, **(self.exchange.collect(flush, others) if others else {})}
            if rnd.failed is None:
                self._post_all(payloads)
        except BaseException as e:
            rnd.fail(e)
            raise
        finally:
            if others:
                self.exchange.answer(flush, others, "" if rnd.failed is None else first_line(rnd.failed))
        if rnd.failed is not None:
            raise rnd.failed

    def _post_all(self, payloads: dict[str, str]) -> None:
        ctx, rnd = self.ctx, self.round

        def post(i: int, engine: EngineEndpoint) -> None:
            body: dict[str, Any] = {"flush_cache": False, "weight_version": str(rnd.version),
                                    "load_format": "flattened_bucket",
                                    "serialized_named_tensors": [payloads[f"{i}/{j}"] for j in range(engine.tp_size)]}
            if ctx.check and ctx.engine_info(engine).get("update_checksums") is True:
                body["return_checksums"] = True
            reply = ctx.post(engine, "/update_weights_from_tensor", body)
            check_reply(reply, f"update_weights_from_tensor ({engine.url})")
            if body.get("return_checksums") and isinstance(reply, dict):
                rnd.report(engine.url, reply.get("checksums"))

        if len(ctx.engines) == 1:
            post(0, ctx.engines[0])
            return
        EngineCalls(ctx.post, [(e, None, i) for i, e in enumerate(ctx.engines)], fn=post).wait(None).raise_first()

    def drop_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def close(self) -> None:
        self.drop_sender()


class TensorHandleStage:
    """One sync's staging into the shared buffers (every feeding rank packs the same flushes, also after a
    failure, so the payload exchange stays in step)."""

    def __init__(self, transport: TensorHandleTransport, sender: SharedBucketSender) -> None:
        self.transport, self.sender = transport, sender

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        for name, t in bucket:
            self.sender.add(name, t)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self) -> dict[str, list[int]]:
        try:
            expected = self.sender.finish()
        finally:
            if not self.sender.reuse:
                self.transport.drop_sender()
        failed = self.transport.round.failed
        if failed is not None:
            raise failed
        return expected

    def abandon(self) -> None:
        """The export failed: the posts already handed to the worker finish on their own."""
