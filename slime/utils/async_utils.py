"""One event loop for the rollout's coroutines, in a daemon thread (upstream slime's `run`).

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


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("run() called from inside the rollout event loop; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
