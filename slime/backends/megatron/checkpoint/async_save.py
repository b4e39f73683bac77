"""`--async-save`: a torch_dist checkpoint whose tensor files are written in the background while training goes on.

Megatron-LM's --async-save takes the AsyncRequest that `dist_checkpointing.save(..., async_sharded_save=True)`
returns and runs it in a forked process (megatron.core's AsyncCallsQueue). slime runs the same request in a thread
of the trainer process instead: forking a process that holds Ray's and the collectives' threads is unsafe, the
staged tensors are host tensors already, and the writes (file IO, torch.save per tensor) overlap the rollout, in
which a trainer rank waits. The steps are Megatron's:

1. stage (`request.preload_fn`, during `save`): device-to-host copies; a tensor already in host memory (the CPU
   device, offloaded state) is cloned, so the optimizer steps that follow cannot change what is written (one
   host copy of the rank's checkpoint tensors until they are written, as with Megatron's device-to-host staging);
2. write (`request.async_fn`, in the thread): this rank's files, into the checkpoint's temp directory;
3. finish (collective, on every rank): megatron's `finalize_fns` gather the write results on the coordinator,
   which writes the metadata, and raise a failed write of any rank on all of them; then the temp directory is
   renamed into place and the tracker replaced. Until then the tracker names the previous checkpoint: a run that
   stops with a save in flight leaves that checkpoint as the one to resume from.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from slime.backends.megatron.ranks import barrier as _barrier


def _own_copies(staged: list, original: list) -> list:
    """Write buckets whose tensors the writer owns: a staged tensor that is the live one (preload_fn returns host
    tensors as they are) is cloned."""
    out = []
    for (file_name, key, (data, tensors)), (_, _, (_, live)) in zip(staged, original):
        live_ids = {id(t) for _, t in live}
        out.append((file_name, key, (data, [(item, t.clone() if id(t) in live_ids else t) for item, t in tensors])))
    return out


class PendingSave:
    """One rank's part of a save whose files are still being written. `finish` is collective."""

    def __init__(self, request: Any, publish: Callable[[], str], final: str) -> None:
        self.final = final  # the iteration directory it becomes
        self._request = request
        self._publish = publish
        self._args = list(request.async_fn_args)
        self._thread = None
        if request.async_fn is None:  # nothing of this rank's to write
            return
        if request.preload_fn is not None:  # megatron's argument order: rank, write buckets, results queue
            self._args[1] = _own_copies(request.preload_fn(), self._args[1])
        self._thread = threading.Thread(target=self._write, name="slime-async-save", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            self._request.async_fn(*self._args, **self._request.async_fn_kwargs)
        except BaseException as e:  # megatron's finalize reports a failed write on every rank (CheckpointException)
            self._args[-1].put(e)

    def written_here(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def finish(self) -> tuple[str, float]:
        """Wait for this rank's writes, finalize and publish (collective). Returns the iteration directory and the
        seconds waited for the writes."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        waited = time.perf_counter() - t0
        _barrier()  # every rank's files are complete before the coordinator writes the metadata
        try:
            for finalize in self._request.finalize_fns:
                finalize()
        except BaseException as e:  # torch's CheckpointException derives from BaseException: not one for Ray's workers
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            cause = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise RuntimeError(f"--async-save: writing {self.final} failed ({cause[-1] if cause else type(e).__name__}); "
                               "the previous checkpoint stays the latest") from e
        return self._publish(), waited


def written_everywhere(pending: PendingSave) -> bool:
    """Collective: whether every rank's writes are done, so that `finish` waits for none."""
    import torch
    import torch.distributed as dist

    done = torch.tensor([1 if pending.written_here() else 0], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item())
