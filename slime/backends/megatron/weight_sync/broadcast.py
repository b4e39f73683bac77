"""Distributed transport: a collective group of trainer rank 0 (one sender per pipeline stage) and every engine
device, formed the way SGLang's `init_weights_update_group` does (slime.utils.distributed); per bucket,
names/dtypes/shapes go over HTTP (`/update_weights_from_distributed`) while the sender broadcasts the tensors
(upstream's update_weight_from_distributed.py). An engine that refuses (or a broadcast that does not finish
within --update-weight-timeout) aborts the group on every side and the sync fails with one line naming the
engine; the group is formed again at the next sync.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron.weight_sync.common import EngineCalls, SyncRound, WeightSyncError
from slime.utils import weight_checksum


class BroadcastTransport:
    """The weight-update group of one WeightSync and the buckets on its wire. `ctx` is the controller
    (slime.backends.megatron.weight_sync.controller.WeightSync): engines, post, role, check, timeout and the
    engines' /get_model_info. `host`: this node's address, where the group's rendezvous store listens."""

    def __init__(self, ctx: Any, host: Callable[[], str]) -> None:
        self.ctx, self.host = ctx, host
        self.group = None
        self.group_host = None  # the rendezvous store this rank hosts for the group
        # the buckets sent and not yet answered, oldest first (engine calls, broadcast works, deadline), the
        # updates numbered on the current group, and the two send buffers
        self.in_flight: list[tuple] = []
        self.sequence = 0
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.next_buffer = 0

    # --- the group ------------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the weight-update group with every engine."""
        from slime.utils.distributed import GroupHost
        from slime.utils.net import free_port

        ctx = self.ctx
        addr, port = self.host(), free_port("")
        world = 1 + sum(e.update_group_ranks for e in ctx.engines)
        backend = get_accelerator().process_group_backend()
        host = GroupHost(addr, port, world, ctx.role.group_name, backend, ctx.timeout_s)
        calls, offset = [], 1
        for engine in ctx.engines:
            calls.append((engine, "/init_weights_update_group", {
                "master_address": addr, "master_port": port, "rank_offset": offset, "world_size": world,
                "group_name": ctx.role.group_name, "backend": backend}))
            offset += engine.update_group_ranks
        threads = EngineCalls(ctx.post, calls)
        try:
            self.group = host.join(refused=threads.first_error)
        except BaseException as e:
            host.abort()  # stops the store: rendezvous still waiting on it fail, here and in the engines
            threads.wait(30)
            self.destroy_on_engines()
            raise WeightSyncError(f"weight-update group not formed: {str(e).splitlines()[0] if str(e) else e!r}; "
                                  "every engine was asked to destroy it") from None
        threads.wait(ctx.timeout_s)
        self.group_host = host
        self.sequence = 0
        threads.raise_first()

    def destroy_on_engines(self) -> None:
        for engine in self.ctx.engines:
            try:
                self.ctx.post(engine, "/destroy_weights_update_group", {"group_name": self.ctx.role.group_name},
                              timeout=30)
            except Exception:
                pass

    def drop_group(self, aborted: bool = False) -> None:
        """Leave the weight-update group on every side. aborted: a broadcast may still be pending, so the
        group is aborted and released in the background (releasing waits for gloo's pending work)."""
        if self.group is None:
            return
        from slime.utils.distributed import destroy_custom_process_group

        group, host, self.group, self.group_host = self.group, self.group_host, None, None
        self.sequence = 0
        if aborted:
            from slime.utils.distributed import abort_custom_process_group

            abort_custom_process_group(group)
        self.destroy_on_engines()
        if aborted:
            threading.Thread(target=destroy_custom_process_group, args=(group,), daemon=True,
                             name="weight-sync-group-release").start()
        else:
            destroy_custom_process_group(group)
        if host is not None:
            host.close()

    def close(self) -> None:
        self.buffers = [None, None]
        if self.ctx.role.sender:
            self.drop_group()

    # --- the engines' offers ---------------------------------------------------------------------
    def takes_flat_broadcasts(self) -> bool:
        """Whether every engine takes /update_weights_from_distributed with load_format flattened_bucket
        (`"distributed_flattened_bucket": true`, the embedded engine): one broadcast per bucket."""
        return all(self.ctx.engine_info(e).get("distributed_flattened_bucket") is True for e in self.ctx.engines)

    def takes_sequenced_updates(self) -> bool:
        """Whether every engine takes a "sequence" number with /update_weights_from_distributed
        (`"distributed_sequence": true`, the embedded engine): then the next bucket goes on the wire as soon
        as the previous one is received, while the engines still copy it into their weights."""
        return all(self.ctx.engine_info(e).get("distributed_sequence") is True for e in self.ctx.engines)

    # --- buckets ------------------------------------------------------------------------------------
    def begin(self, rnd: SyncRound) -> "BroadcastStage":
        return BroadcastStage(self, rnd)

    def _packed(self, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list, list[torch.Tensor]]:
        """The bucket (widest dtype first, so SGLang's gapless layout keeps every tensor aligned) packed into the
        next of the two send buffers, which are kept across buckets and syncs."""
        from slime.backends.megatron.weight_sync.shared_buckets import pack_into

        bucket = sorted(bucket, key=lambda nt: -nt[1].element_size())  # stable: export order within a dtype
        starts, nbytes = [], 0
        for _, t in bucket:
            starts.append(nbytes)
            nbytes += t.numel() * t.element_size()
        slot, self.next_buffer = self.next_buffer, 1 - self.next_buffer
        buffers = self.buffers
        if buffers[slot] is None or buffers[slot].numel() < nbytes or buffers[slot].device != device:
            buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pack_into(buffers[slot], [(o, t.to(device)) for o, (_, t) in zip(starts, bucket)])
        get_accelerator().synchronize()  # packed before the broadcast reads it
        return bucket, [buffers[slot][:nbytes]]

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Start sending one bucket: its names to every engine over HTTP while this rank broadcasts its tensors.
        Engines that take flattened buckets get the bucket's bytes in one broadcast (`_packed`); other engines
        one broadcast per tensor. The previous bucket's broadcast finishes first (a group carries one broadcast
        at a time) but after this one is packed: the export and packing of a bucket overlap the broadcast of
        the one before. Engines that take numbered updates (`takes_sequenced_updates`) get this bucket while
        they still copy the previous one (its reply is awaited before the next bucket, so a send buffer is
        refilled only once its bucket is received); others answer each bucket before the next is sent
        (`finish` waits for the last)."""
        from slime.utils.distributed import broadcast_async

        device = get_accelerator().device()
        flat = self.takes_flat_broadcasts()
        if flat:
            bucket, tensors = self._packed(bucket, device)
        else:
            tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.ctx.role.group_name,
                   "flush_cache": False, "weight_version": str(version)}
        if flat:
            payload["load_format"] = "flattened_bucket"
        sequenced = self.takes_sequenced_updates()
        if sequenced:
            payload["sequence"] = self.sequence
        self.finish(keep_last=sequenced)
        # The engines block in the broadcast until this rank sends, so their HTTP calls run alongside.
        calls = EngineCalls(self.ctx.post, [(e, "/update_weights_from_distributed", payload) for e in self.ctx.engines])
        works = [broadcast_async(t, src=0, group=self.group) for t in tensors]
        self.sequence += 1
        self.in_flight.append((calls, works, time.monotonic() + self.ctx.timeout_s))

    def finish(self, keep_last: bool = False) -> None:
        """Wait for the buckets sent: every broadcast received, then every engine's answer (`keep_last`: all
        but the last bucket's, which may still be copied). An engine that refuses a bucket while a broadcast
        is pending, or a broadcast still pending after the timeout, aborts the group everywhere; the next
        sync forms it again."""
        flights = self.in_flight
        if not flights:
            return
        self._wait_received(flights)
        answered = flights[:-1] if keep_last else flights
        self.in_flight = flights[len(answered):]
        error = None
        for calls, _, _ in answered:
            error = error or calls.wait(self.ctx.timeout_s).first_error()
        if error is not None:  # every answer is in before the sync fails
            for calls, _, _ in self.in_flight:
                calls.wait(self.ctx.timeout_s)
            self.in_flight = []
            raise error

    def _wait_received(self, flights: list[tuple]) -> None:
        while not all(w.is_completed() for _, works, _ in flights for w in works):
            refused = next((c.first_error() for c, _, _ in flights if c.first_error() is not None), None)
            late = any(time.monotonic() > deadline and not all(w.is_completed() for w in works)
                       for _, works, deadline in flights)
            if refused is not None or late:
                self.in_flight = []
                self.drop_group(aborted=True)
                for calls, _, _ in flights:
                    calls.wait(30)
                if refused is None:
                    pending = [u for c, _, _ in flights for u in c.pending_urls()]
                    raise WeightSyncError(f"weight broadcast not received by every engine within "
                                          f"{self.ctx.timeout_s:.0f} s (--update-weight-timeout); pending engines: "
                                          f"{pending}; the weight-update group was aborted and is formed again at "
                                          "the next sync")
                raise WeightSyncError(f"{str(refused).splitlines()[0]}; the weight-update group was aborted on every "
                                      "engine and is formed again at the next sync") from None
            time.sleep(0.001)
        for _, works, _ in flights:
            for w in works:
                w.wait()


class BroadcastStage:
    """One sync's buckets on the group's wire. After the round's first failure the export only drains."""

    def __init__(self, transport: BroadcastTransport, rnd: SyncRound) -> None:
        self.transport, self.round = transport, rnd
        self.expected: dict[str, list[int]] = {}

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        if self.round.failed is not None:
            return 0
        ctx = self.transport.ctx
        if ctx.check:
            self.expected.update(weight_checksum.named_checksums(bucket))
        try:
            if self.transport.group is None:
                ctx.connect()
            self.transport.send(bucket, self.round.version)
        except BaseException as e:  # noqa: BLE001 - keep iterating: the other ranks are in the export's collectives
            self.round.fail(e)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self) -> dict[str, list[int]]:
        try:
            self.transport.finish()  # the last bucket (also after a failure: nothing left on the wire)
        except BaseException as e:  # noqa: BLE001 - raised below with the first failure
            self.round.fail(e)
        if self.round.failed is not None:
            raise self.round.failed
        return self.expected

    def abandon(self) -> None:
        """The export itself failed with a bucket on the wire: wait for it (the first error is the one reported)."""
        if self.transport.in_flight:
            try:
                self.transport.finish()
            except BaseException:  # noqa: BLE001
                pass
