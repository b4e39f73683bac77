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
import sys
import threading
import time
from typing import Callable, Iterator

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

    def __reduce__(self):  # rebuilt from the signal number, not the message (e.g. across Ray)
        return type(self), (self.signum,)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []  # signals seen by the handler, in order


def _raise_interrupted(signum: int, _frame) -> None:
    _received.append(signum)
    _notify_watchdog(signum)
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
    _installed.append(True)
    reclaim_signal_handlers()


_installed: list[bool] = []  # install_signal_handlers ran (train.py's main): reclaim only then


def reclaim_signal_handlers() -> None:
    """Put the handlers back after a library replaced them (signals seen so far are kept). `ray.init` does:
    it sets a Python SIGTERM handler (`sys.exit(15)`) and its core worker installs absl's crash handler,
    which takes SIGTERM at the C level (a crash dump, then SIGABRT: exit 134, no cleanup). A process that
    never installed them (a library user calling `train.train`) keeps its own."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    for s in _HANDLED:
        signal.signal(s, _raise_interrupted)


@contextlib.contextmanager
def library_signal_handlers_reclaimed() -> Iterator[None]:
    """Run a call that installs its own SIGTERM handler (`ray.init`): our handlers are put back after it,
    and its handler's `sys.exit(SIGTERM)` during the call becomes `Interrupted`, so that stage also exits
    143 through the same cleanup."""
    try:
        yield
    except SystemExit as e:
        if e.code == signal.SIGTERM:
            _received.append(signal.SIGTERM)
            raise Interrupted(signal.SIGTERM) from None
        raise
    finally:
        reclaim_signal_handlers()


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Run cleanup without being interrupted again; signals that arrive meanwhile are recorded."""
    seen: list[int] = []
    previous = {s: signal.getsignal(s) for s in _HANDLED}
    def record(signum, _frame) -> None:
        seen.append(signum)
        _received.append(signum)  # ray_core_dead gives Ray's processes time to show a SIGTERM
        _notify_watchdog(signum)

    for s in _HANDLED:
        signal.signal(s, record)
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


# ------------------------------------------------------------------ the local Ray session's processes
def local_ray_node_pids() -> dict[str, int]:
    """{name: pid} of the Ray node processes this driver started (gcs_server, raylet, ...); {} when it
    joined a cluster or Ray is not running."""
    try:
        import ray

        node = ray._private.worker._global_node
        if node is None or not node.head:
            return {}
        return {name: infos[0].process.pid for name, infos in node.all_processes.items() if infos}
    except Exception:
        return {}


_core_waited: list[bool] = []


def ray_core_dead() -> bool:
    """Whether the local Ray session's GCS or raylet has exited (or is exiting): a SIGTERM sent to the whole
    process group (`timeout`, `kill -TERM -PGID`, Slurm) reaches them too (Ray blocks only SIGINT in them).
    Ray calls would then wait 60 s for the GCS and end the process, so the cleanup goes around Ray
    (`kill_session_processes`). After a SIGTERM they are given up to 2 s to show it."""
    try:
        import ray

        node = ray._private.worker._global_node
        if node is None or not node.head:
            return False
        core = [info.process for name in ("gcs_server", "raylet") for info in node.all_processes.get(name) or []]
    except Exception:
        return False
    wait = 2.0 if signal.SIGTERM in _received and not _core_waited else 0.0
    _core_waited.append(True) if wait else None  # once per process: later checks answer at once
    deadline = time.monotonic() + wait
    while True:
        if any(p.poll() is not None for p in core):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def local_ray_node_id() -> str | None:
    try:
        import ray

        node = ray._private.worker._global_node
        return node.node_id if node is not None and node.head else None
    except Exception:
        return None


def kill_session_processes(raylet_pid: int | None, grace_s: float = 3.0, node_id: str | None = None) -> int:
    """Stop every process of the local Ray session still running: the workers (Ray gives them
    RAY_RAYLET_PID; their children, e.g. an engine's server, inherit it) and the raylet's agents (its
    children; orphaned ones are found by the RAY_NODE_ID they carry, when `node_id` is given). SIGTERM,
    then SIGKILL after `grace_s`. Returns how many were found."""
    if not raylet_pid and not node_id:
        return 0
    import psutil

    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if (raylet_pid and env.get("RAY_RAYLET_PID") == str(raylet_pid)) or (node_id and env.get("RAY_NODE_ID") == node_id):
            found.append(p)
    try:  # the agents run under the raylet
        found += [c for c in psutil.Process(raylet_pid).children(recursive=True) if c not in found] if raylet_pid else []
    except psutil.Error:
        pass
    for p in found:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(found)


# ------------------------------------------------------------------ a stop that Ray does not let through
_watch: dict = {}  # "fd": write end of the watchdog's pipe, "done": set once the exit line is printed


def _notify_watchdog(signum: int) -> None:
    fd = _watch.get("fd")
    if fd is not None:
        try:
            os.write(fd, bytes([signum]))
        except OSError:
            pass


def mark_exit_reported() -> None:
    """The main thread has printed the run's last line: the watchdog must not take over any more."""
    if "done" in _watch:
        _watch["done"].set()


def start_stop_watchdog(take_over: Callable[[int], bool], grace_s: float = 5.0) -> None:
    """A thread that sees SIGINT/SIGTERM even while the main thread is stuck inside a Ray call that does not
    return (the GCS died from the same group signal: Ray retries for 60 s, then aborts): the signal's
    C-level wake-up byte (`signal.set_wakeup_fd`; slime.ray.waiting puts this fd back after its waits) or
    the handler's own write reach it; `grace_s` later, if the main thread has not reported the exit yet,
    `take_over(signum)` runs there (it returns True when it ended the stop itself)."""
    if "fd" in _watch or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    done = threading.Event()
    _watch.update(fd=w, done=done, previous_fd=signal.set_wakeup_fd(w, warn_on_full_buffer=False))

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:  # stop_stop_watchdog closed the write end
                os.close(r)
                return
            stops = [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
            if not stops:
                continue
            if done.wait(grace_s):
                return
            if take_over(stops[0]):
                return

    threading.Thread(target=watch, name="slime-stop-watchdog", daemon=True).start()


def stop_stop_watchdog() -> None:
    """Undo `start_stop_watchdog`: when train.py's main returns inside a longer-lived process (a test, a
    library caller), a later signal there must not wake a watchdog that would end that process."""
    w = _watch.pop("fd", None)
    if w is None:
        return
    _watch.pop("done").set()
    previous = _watch.pop("previous_fd", -1)
    if threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(previous)
    os.close(w)


@contextlib.contextmanager
def stop_handling(take_over: Callable[[int], bool]) -> Iterator[None]:
    """train.py's main: our SIGINT/SIGTERM handlers and the stop watchdog for the call, then the process's
    own handlers back (main may run inside a longer-lived process, e.g. a test)."""
    owner = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in _HANDLED} if owner else {}
    install_signal_handlers()
    start_stop_watchdog(take_over)
    try:
        yield
    finally:
        stop_stop_watchdog()
        _installed.clear()
        for s, h in previous.items():
            signal.signal(s, h)


def hard_exit(code: int, line: str) -> None:
    """Print the last line and end the process now (no interpreter shutdown: Ray's atexit hooks would wait
    for the dead GCS)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


def end_entry_point(code: int | None) -> None:
    """`sys.exit(code)` for a command whose work is done (train.py, the embedded engine's server), with every
    object alive now frozen (`gc.freeze`) first, so that the interpreter's exit skips the cycle collector's passes
    over them. Why: in a process that imported torch, transformers, megatron-core and Ray those passes took
    1.6-3.1 s of its exit (0.2-0.6 s frozen, 1.2 core-s less; load 6-7 on 2 cores), and a run's driver and its
    engines exit on the path a caller waits on. Everything else of the exit is unchanged (non-daemon threads
    joined, atexit handlers, modules torn down by reference counting, files flushed); only objects in reference
    cycles made before the call are not collected, whose finalizers Python never promises at exit. Only in
    `__main__` blocks: a process that goes on (a test calling main()) would keep those objects for good."""
    import gc

    gc.freeze()
    sys.exit(code)
