"""Tensor parallel for the embedded engine: one engine over `tp_size` processes (one per device, possibly on
several nodes, as an SGLang engine spans nodes with --nnodes), joined by one process group.

Split: every `nn.Linear` whose output features divide by tp_size computes its own rows of the weight (rank r:
rows r*n/tp .. (r+1)*n/tp) and the ranks all-gather the outputs, so each matmul's work is divided; everything
else (norms, attention over the gathered heads, routed experts held as fused parameters) runs on every rank.
Each rank keeps the full weights, so weight updates, checksums and memory release are the single-process code
on rank 0, whose changes are broadcast to the others. (SGLang's tensor parallel, the production path, also
divides the memory; this engine is the CPU / development one.)

Lockstep: rank 0 runs the HTTP server and the scheduler. Before each forward step, cache row selection and weight
change it broadcasts one command (a fixed-size int64 header, then its tensors) and the followers repeat it on
their own model and KV cache, so every rank makes the same collective calls in the same order. Payloads are
tensors and JSON names, never pickles.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import types
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_HEADER = 8
FORWARD, SELECT, WEIGHTS, RELEASE, RESUME, STOP = range(1, 7)
# An engine idles between rollouts for as long as training takes; a follower waits for the next command that long.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class TensorParallelConfig:
    tp_size: int
    tp_rank: int
    dist_init_addr: str  # host:port of rank 0's rendezvous (SGLang's --dist-init-addr)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"dist_init_addr {self.dist_init_addr!r} must be host:port (rank 0's address)")


def init_group(cfg: TensorParallelConfig):
    """The engine's process group (the accelerator's backend), formed at rank 0's dist_init_addr the way
    SGLang's engines join a custom group (slime.utils.distributed)."""
    from slime.utils.distributed import init_custom_process_group

    host, _, port = cfg.dist_init_addr.rpartition(":")
    return init_custom_process_group(host.strip("[]"), int(port), cfg.tp_size, cfg.tp_rank, "embedded_tp",
                                     timeout_s=IDLE_TIMEOUT.total_seconds())


def split_linears(model: torch.nn.Module, cfg: TensorParallelConfig, group) -> int:
    """Make every divisible nn.Linear compute its rank's output rows and all-gather them. Parameters keep their
    names and full shapes (weight updates address them as before). Returns how many layers were split."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.out_features % cfg.tp_size == 0:
            module.forward = types.MethodType(functools.partial(_split_forward, cfg=cfg, group=group), module)
            count += 1
    return count


def _split_forward(self: torch.nn.Linear, x: torch.Tensor, cfg: TensorParallelConfig, group) -> torch.Tensor:
    rows = self.out_features // cfg.tp_size
    lo = cfg.tp_rank * rows
    bias = self.bias[lo:lo + rows] if self.bias is not None else None
    part = F.linear(x, self.weight[lo:lo + rows], bias).contiguous()
    parts = [torch.empty_like(part) for _ in range(cfg.tp_size)]
    dist.all_gather(parts, part, group=group)
    return torch.cat(parts, dim=-1)


class Lockstep:
    """Rank 0's side: `forward`, `select` and `weights_changed` broadcast their command, then run it locally."""

    def __init__(self, model: torch.nn.Module, group, device: torch.device) -> None:
        self.group, self.device = group, device
        self.lock = threading.RLock()  # one command (header, tensors, the forward's collectives) at a time
        self._inner_forward = model.forward
        self._cache = None

        @functools.wraps(self._inner_forward)
        def forward(*args: Any, **kwargs: Any):
            return self._forward(*args, **kwargs)

        model.forward = forward  # the engine calls the model as before

    def _send(self, op: int, *values: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        header[0] = op
        header[1:1 + len(values)] = torch.tensor(values, dtype=torch.long)
        _bcast(header, src=0, group=self.group)

    def _forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs: Any):
        cache = next((kwargs[k] for k in ("past_key_values", "cache") if k in kwargs), None)
        with self.lock:
            new = cache is not self._cache
            if new and cache is not None:
                self._cache = cache
                _watch_selects(cache, self)
            ids, mask, pos = input_ids.contiguous(), attention_mask.contiguous(), position_ids.contiguous()
            self._send(FORWARD, int(new), ids.shape[0], ids.shape[1], mask.shape[1],
                       int("logits_to_keep" in kwargs and kwargs["logits_to_keep"] or 0))
            for t in (ids, mask, pos):
                _bcast(t, src=0, group=self.group)
            return self._inner_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       **kwargs)

    def select(self, idx: torch.Tensor) -> None:
        with self.lock:
            self._send(SELECT, int(idx.numel()))
            _bcast(idx.to(self.device, torch.long).contiguous(), src=0, group=self.group)

    def weights_changed(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """After rank 0 changed these weights (held under the engine's model lock): the same bytes to every rank."""
        with self.lock:
            names = json.dumps([n for n, _ in named]).encode()
            self._send(WEIGHTS, len(names))
            _bcast(torch.frombuffer(bytearray(names), dtype=torch.uint8).to(self.device), src=0,
                           group=self.group)
            for _, t in named:
                _broadcast_bytes(t, self.group)

    def memory(self, op: int, tags: list[str] | None) -> None:
        with self.lock:
            data = json.dumps(tags).encode()
            self._send(op, len(data))
            _bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), src=0,
                           group=self.group)

    def stop(self) -> None:
        with self.lock:
            try:
                self._send(STOP)
            except RuntimeError as e:  # a follower already gone (stopped first, or crashed): nothing to tell it
                logger.info("embedded engine TP: a follower is gone at shutdown (%s)", str(e).splitlines()[0])


def _watch_selects(cache: Any, lockstep: Lockstep) -> None:
    """The scheduler drops finished rows from its KV cache with batch_select_indices: followers drop the same."""
    inner = cache.batch_select_indices

    def select(indices: torch.Tensor):
        lockstep.select(indices)
        return inner(indices)

    cache.batch_select_indices = select


def _bcast(t: torch.Tensor, src: int, group) -> None:
    dist.broadcast(t, group=group, group_src=src)


def _broadcast_bytes(t: torch.Tensor, group) -> None:
    """Broadcast a tensor in place as raw bytes (any dtype the backend lacks, e.g. bfloat16 over gloo)."""
    if not t.is_contiguous():
        buf = t.contiguous()
        _broadcast_bytes(buf, group)
        t.copy_(buf)
        return
    if t.numel():
        _bcast(t.view(-1).view(torch.uint8), src=0, group=group)


def follow(engine: Any, group) -> None:
    """A follower rank's loop: repeat rank 0's commands on this rank's model until STOP (or rank 0 goes away,
    which raises from the next broadcast)."""
    device = engine.device
    forward = engine.model.forward
    cache = None
    header = torch.empty(_HEADER, dtype=torch.long, device=device)

    def recv(shape, dtype=torch.long) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        _bcast(t, src=0, group=group)
        return t

    def recv_json(n: int) -> Any:
        return json.loads(bytes(recv((n,), torch.uint8).cpu().tolist()).decode())

    with torch.inference_mode():
        while True:
            _bcast(header, src=0, group=group)
            op, *v = header.tolist()
            if op == FORWARD:
                new, batch, seq, width, keep = v[:5]
                ids, mask, pos = recv((batch, seq)), recv((batch, width)), recv((batch, seq))
                if new:
                    cache = engine._new_cache()
                kwargs = {engine._cache_kw: cache, "use_cache": True}
                if keep:
                    kwargs["logits_to_keep"] = keep
                with engine._model_lock:
                    forward(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
            elif op == SELECT:
                cache.batch_select_indices(recv((v[0],)))
            elif op == WEIGHTS:
                with torch.no_grad(), engine._model_lock:
                    for name in recv_json(v[0]):
                        _broadcast_bytes(engine.name_map.resolve(name), group)
            elif op in (RELEASE, RESUME):
                tags = recv_json(v[0])
                (engine.release_memory if op == RELEASE else engine.resume_memory)(tags)
            elif op == STOP:
                return
            else:
                raise RuntimeError(f"embedded engine TP rank: unknown command {op} from rank 0")


def attach(engine: Any, cfg: TensorParallelConfig):
    """Join the engine's TP group and split its linear layers; rank 0 also gets the Lockstep (`engine.tp`)."""
    group = init_group(cfg)
    split = split_linears(engine.model, cfg, group)
    if cfg.tp_rank == 0:
        engine.tp = Lockstep(engine.model, group, engine.device)
    logger.info("embedded engine TP rank %d/%d: %d linear layers split", cfg.tp_rank, cfg.tp_size, split)
    return group
