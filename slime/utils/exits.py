"""How a run ends: signals become an `Interrupted` exception (so the same cleanup runs as after a crash),
errors from Ray actors become one console line, and shared memory left by trainer ranks is released.

Exit statuses: 0 done, 1 error, 2 bad input (before Ray), 128 + signal number when interrupted
(130 for SIGINT / Ctrl-C, 143 for SIGTERM). `SLIME_DEBUG=1` shows full tracebacks instead of one line.
"""

from __future__ import annotations

import builtins
import contextlib
import glob
import os
import re
import signal
from typing import Iterator

DEBUG_ENV = "SLIME_DEBUG"
_HANDLED = (signal.SIGINT, signal.SIGTERM)


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; a BaseException so that `except Exception` blocks do not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"{self.name} received")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []  # signals seen by the handler, in order


def _raise_interrupted(signum: int, _frame) -> None:
    _received.append(signum)
    raise Interrupted(signum)


def interruption(e: BaseException) -> Interrupted | None:
    """The `Interrupted` behind `e`: raised inside C code (a Ray call), the handler's exception can surface
    wrapped (e.g. as a SystemError "returned a result with an exception set"), or a Ray error can follow
    the signal; any exception after a handled signal counts as the interruption."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, Interrupted):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return Interrupted(_received[0]) if _received else None


def install_signal_handlers() -> None:
    """SIGINT/SIGTERM raise `Interrupted` in the main thread (Ctrl-C would otherwise be KeyboardInterrupt,
    SIGTERM an exit without cleanup)."""
    _received.clear()
    for s in _HANDLED:
        signal.signal(s, _raise_interrupted)


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Run cleanup without being interrupted again; signals that arrive meanwhile are recorded."""
    seen: list[int] = []
    previous = {s: signal.getsignal(s) for s in _HANDLED}
    for s in _HANDLED:
        signal.signal(s, lambda signum, _frame: seen.append(signum))
    try:
        yield seen
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def root_cause(e: BaseException) -> BaseException:
    """The exception raised inside a Ray actor or task, unwrapped from Ray's RayTaskError layers."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - ray is a dependency
        return e
    for _ in range(10):
        cause = getattr(e, "cause", None)
        if not isinstance(e, RayTaskError) or not isinstance(cause, BaseException):
            break
        e = cause
    return e


def _ray_logs_dir() -> str | None:
    try:
        import ray

        node = ray._private.worker._global_node  # the local session; its logs outlive ray.shutdown()
        return node.get_logs_dir_path() if node is not None else None
    except Exception:
        return None


def actor_log(pid: int | None, logs_dir: str | None) -> str | None:
    """The Ray worker log (stderr) of process `pid`."""
    if not pid or not logs_dir:
        return None
    found = sorted(glob.glob(os.path.join(logs_dir, f"worker-*-{pid}.err")))
    return found[-1] if found else None


def _last_exception_line(text: str) -> str:
    """The exception at the end of a formatted traceback: slime's own errors by their message (it names the
    problem and the fix), Python's built-in ones with their type ("KeyError: 'w'")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    m = re.match(r"^([\w.]+): (.*)$", lines[-1]) if lines else None
    if not m:
        return lines[-1] if lines else text
    name = m.group(1).rsplit(".", 1)[-1]
    return f"{name}: {m.group(2)}" if hasattr(builtins, name) else m.group(2)


def describe_error(e: BaseException, logs_dir: str | None = None) -> list[str]:
    """Console lines for an error that ends the run: one line naming the problem (and where the actor's
    log is); an engine's log tail, when the error carries one, follows indented."""
    cause = root_cause(e)
    text = str(cause).strip() or type(cause).__name__
    pid = getattr(e, "pid", None)
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        RayActorError = ()  # type: ignore[assignment]
    if isinstance(cause, RayActorError):
        found = re.search(r"\bpid[:=]\s*(\d+)", text)
        pid = int(found.group(1)) if found else pid
        if cause.actor_init_failed:  # an actor's __init__ raised: its exception, the traceback's last line
            text = _last_exception_line(text) + " (raised while starting a Ray actor)"
        else:
            text = f"{type(cause).__name__}: {' '.join(text.split())}"
    elif "Traceback (most recent call last)" in text:  # a cause Ray could not rebuild: its formatted text
        text = _last_exception_line(text)
    first, _, rest = text.partition("\n")
    log = actor_log(pid, logs_dir or _ray_logs_dir())
    lines = [first + (f" (actor log: {log})" if log else "")]
    if "last lines:" in first:  # an engine's exit report: show the tail
        lines += ["  | " + line for line in rest.splitlines()[-20:]]
    return lines
