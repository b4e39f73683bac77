"""Waiting for Ray results without waking up meanwhile: the driver's CPU time per wait is constant.

`ray.get` waits in slices of RAY_get_check_signal_interval_milliseconds (1 s) so that Python can run
signal handlers; every slice costs the waiting thread CPU time (~0.05 ms per second of waiting on a
2-core machine), so the driver's CPU time grew with the wall time of the rollout and training calls.
Here the waiting thread sleeps in select() on a self-pipe instead: Ray writes to it once per finished
reference (a completion callback), and signals write to it too (`signal.set_wakeup_fd`), so SIGINT/SIGTERM
still interrupt the wait at once. The results are then read with one `ray.get` that does not block.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any, Sequence

_pipe: tuple[int, int, int] | None = None  # (read end, write end, owning pid); never closed
_pipe_lock = threading.Lock()


def _wake_pipe() -> tuple[int, int]:
    """This process's self-pipe (a forked child makes its own: it must not share the parent's)."""
    global _pipe
    with _pipe_lock:
        if _pipe is None or _pipe[2] != os.getpid():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)  # set_wakeup_fd needs it; a full pipe means a wake-up is pending anyway
            _pipe = (r, w, os.getpid())
        return _pipe[0], _pipe[1]


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except OSError:  # full: the waiter has a wake-up pending already
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


_futures: dict = {}  # ObjectRef -> its future while pending: a repeated wait (a progress loop) adds no callback
_futures_lock = threading.RLock()  # a done future runs its callback inside add_done_callback


def _future(ref: Any, wake_fd: int):
    with _futures_lock:
        f = _futures.get(ref)
        if f is None:
            f = _futures[ref] = ref.future()

            def finished(_f, ref=ref):
                with _futures_lock:
                    _futures.pop(ref, None)
                _poke(wake_fd)

            f.add_done_callback(finished)  # runs at once (and drops the entry) when already done
        return f


def wait_ready(refs: Sequence[Any], timeout: float | None = None) -> bool:
    """Block until every object reference in `refs` is ready, or one of them holds an error (True), or
    `timeout` seconds passed (False). Errors are not raised here: `ray.get` raises them. An error ends the
    wait at once: the ranks of a trainer wait on each other in collectives, so when one fails the others may
    never finish, and waiting for them would hide the failure for as long as their timeouts. Off the main
    thread (where signal wake-ups cannot be set) this is `ray.wait` for all of them."""
    return _wait(list(refs), timeout)[0]


def get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get(refs)` (one reference or a list) after `wait_ready`; raises ray's GetTimeoutError on timeout,
    and the first error among `refs` as soon as it is there (the others may still run)."""
    import ray

    many = isinstance(refs, (list, tuple))
    listed = list(refs) if many else [refs]
    ready, failed = _wait(listed, timeout)
    if not ready:
        raise ray.exceptions.GetTimeoutError(f"not ready after {timeout} s")
    if failed is not None:
        ray.get(listed[failed])  # raises that reference's error
    return ray.get(listed if many else refs)


def _wait(refs: list[Any], timeout: float | None) -> tuple[bool, int | None]:
    """(ready, index of the reference whose error ended the wait early, or None)."""
    import ray

    if not refs:
        return True, None
    if threading.current_thread() is not threading.main_thread():
        return len(ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)[0]) == len(refs), None
    r, w = _wake_pipe()
    futures = [_future(ref, w) for ref in refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    try:
        while not all(f.done() for f in futures):
            failed = next((i for i, f in enumerate(futures) if f.done() and f.exception() is not None), None)
            if failed is not None:
                return True, failed
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False, None
            select.select([r], [], [], left)  # a signal's handler runs (and may raise) right after
            _drain(r)
    finally:
        signal.set_wakeup_fd(previous)
    return True, None
