"""A rollout-engine server as a child process (SGLang or the embedded engine): start it with its log
streamed to a file, wait for /health, report exit code and log tail, stop it cleanly.

The server runs in its own session (process group), so stopping it also stops the workers it
spawns (SGLang's scheduler and detokenizer processes): SIGTERM to the group, SIGKILL after a grace
period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


class EngineStartError(RuntimeError):
    """The server exited or never became healthy. The message names the server, exit code and log tail."""


@dataclass
class ServerProcess:
    name: str  # "engine 0", for messages
    cmd: list[str]
    env: dict[str, str]  # full environment of the child
    log_path: str
    url: str
    # SIGTERM the server when its starter dies (guard.py). Linux ties this to the starting *thread*:
    # call start() from a long-lived thread (a Ray actor's, the main thread).
    die_with_parent: bool = True
    proc: subprocess.Popen | None = field(default=None, init=False)
    starts: int = field(default=0, init=False)

    def start(self) -> None:
        if self.running():
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)) or ".", exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        log.write(f"\n===== {self.name} start {self.starts + 1}: {' '.join(self.cmd)}\n".encode())
        cmd = list(self.cmd)
        if self.die_with_parent:
            cmd = [sys.executable, "-m", "slime.backends.sglang.guard", str(os.getpid()), "--"] + cmd
        try:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()  # the child holds its own descriptor
        self.starts += 1

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def describe_exit(self) -> str:
        code = self.exit_code()
        how = "is still running" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        return f"{self.name} ({self.url}, pid {self.pid}) {how}; log {self.log_path}, last lines:\n{self.log_tail()}"

    def wait_healthy(self, timeout: float, token: str | None = None) -> None:
        from slime.utils.http_client import EngineClient, EngineUnreachable

        try:
            EngineClient(self.url, token).wait_healthy(timeout, alive=self.running)
        except EngineUnreachable as e:
            if self.running():
                self.stop()
                raise EngineStartError(f"{self.name} not healthy after {timeout:.0f}s; {self.describe_exit()}") from e
            raise EngineStartError(self.describe_exit()) from e

    def stop(self, grace: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=grace)
        # Workers left in the group after the leader exited.
        self._signal(signal.SIGKILL)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server's process group (fault injection; `stop` for normal shutdown)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # our child's own session: its pgid is its pid
        except (ProcessLookupError, PermissionError):
            pass


def wait_port_free(port: int, timeout: float = 10.0) -> bool:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                time.sleep(0.1)
    return False
