"""Least-outstanding-requests routing across engines, with engines taken out while they restart."""

from __future__ import annotations

import threading


class NoEngineAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("the router needs at least one engine")
        self.outstanding = [0] * n
        self.usable = [True] * n
        self.served = [0] * n
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> int:
        """Index of the usable engine with the fewest requests in flight (ties: lowest index); counts one more.
        Waits while every engine is out (restarting); NoEngineAvailable after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: any(self.usable), timeout=timeout):
                raise NoEngineAvailable("no rollout engine is usable (all are down or restarting)")
            idx = min((i for i, ok in enumerate(self.usable) if ok), key=lambda i: (self.outstanding[i], i))
            self.outstanding[idx] += 1
            return idx

    def release(self, idx: int, served: bool = True) -> None:
        with self._cond:
            self.outstanding[idx] -= 1
            if served:
                self.served[idx] += 1
            self._cond.notify_all()

    def set_usable(self, idx: int, usable: bool) -> None:
        with self._cond:
            self.usable[idx] = usable
            self._cond.notify_all()

    def any_usable(self) -> bool:
        with self._cond:
            return any(self.usable)
