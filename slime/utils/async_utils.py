"""One event loop for the rollout's coroutines, in a daemon thread (upstream slime's `run`, `get_async_loop`,
`AsyncLoopThread`).

Plugins' state (GenerateState's semaphore, clients) belongs to one loop, so every rollout runs its
coroutines on the same loop: `run(coro)` blocks the caller until it is done and returns its result."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-async", daemon=True).start()
        return _loop


class AsyncLoopThread:
    """Upstream's handle on a loop running in a daemon thread: `.loop`, `.run(coro)` (blocks until done). Without
    `loop`, a new loop and thread of its own; `get_async_loop()` gives the rollout's."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="slime-async-extra", daemon=True).start()
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_handle: AsyncLoopThread | None = None


def get_async_loop() -> AsyncLoopThread:
    """The rollout's event loop (the one `run` uses) as upstream's AsyncLoopThread."""
    global _handle
    loop = get_loop()
    if _handle is None or _handle.loop is not loop:
        _handle = AsyncLoopThread(loop)
    return _handle


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("run() called from inside the rollout event loop; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
