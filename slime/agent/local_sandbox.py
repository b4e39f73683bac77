"""`LocalSandbox`: upstream's `slime.agent.sandbox.Sandbox` contract (exec, write_file, read_file, async
context) over local subprocesses, for agent rollouts whose tools run on the rollout host.

Each command runs in `bash -c` inside its own network namespace (no interface up, not even loopback: no
network at all) and mount namespace, where the sandbox's own temporary directory is mounted on /tmp and the
working directory is /tmp/work. When slime runs as root the command runs as `nobody` (uid 65534), so it can
write only there; otherwise as the calling user in a user namespace. Each command has a time limit (killed,
exit 124) and an output limit per stream (the rest dropped, a note appended). Leaving the context kills
whatever the sandbox started, detached processes included (found by the sandbox id in their environment),
and removes the directory. Files are exchanged as text or bytes; nothing read back is unpickled.

Paths in `write_file` / `read_file`: absolute under /tmp (the sandbox's /tmp), or relative to /tmp/work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

UNPRIVILEGED_UID = 65534  # nobody
EXIT_TIMEOUT = 124  # as coreutils' timeout
EXIT_SETUP_FAILED = 125
WORKDIR = "/tmp/work"
_READ_CHUNK = 65536
_LAUNCHER = """mount --bind "$SLIME_SANDBOX_ROOT" /tmp || exit 125
cd /tmp/work || exit 125
unset SLIME_SANDBOX_ROOT
if [ "$SLIME_SANDBOX_DROP" = 1 ]; then
  exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all bash -c "$1"
fi
exec bash -c "$1"
"""


def _namespace_prefix() -> list[str]:
    if os.geteuid() == 0:
        return ["unshare", "--net", "--mount"]
    return ["unshare", "--user", "--map-root-user", "--net", "--mount"]


def isolation_problem() -> str | None:
    """Why commands cannot be isolated here (None when they can)."""
    if shutil.which("unshare") is None or (os.geteuid() == 0 and shutil.which("setpriv") is None):
        return "util-linux's unshare and setpriv are needed (apt-get install util-linux)"
    try:
        probe = subprocess.run([*_namespace_prefix(), "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if probe.returncode != 0:
        return f"unshare cannot create network and mount namespaces here: {probe.stderr.strip()[:200]}"
    return None


class _Capped:
    """Reads a stream to its end, keeping the first `limit` bytes."""

    def __init__(self, stream: asyncio.StreamReader, limit: int) -> None:
        self.kept, self.dropped = bytearray(), 0
        self.task = asyncio.ensure_future(self._read(stream, limit))

    async def _read(self, stream: asyncio.StreamReader, limit: int) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            room = max(0, limit - len(self.kept))
            self.kept += chunk[:room]
            self.dropped += len(chunk) - min(room, len(chunk))

    def text(self) -> str:
        note = f"\n[output truncated: {self.dropped} more bytes]" if self.dropped else ""
        return self.kept.decode(errors="replace") + note


class LocalSandbox:
    """See the module doc. `max_output_bytes` caps stdout and stderr each; `default_timeout` applies when
    `exec` gets none."""

    def __init__(self, *, max_output_bytes: int = 1 << 20, default_timeout: int = 120, env: dict | None = None) -> None:
        self.sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        self.max_output_bytes = max_output_bytes
        self.default_timeout = default_timeout
        self.base_env = dict(env or {})
        self.root: Path | None = None

    async def __aenter__(self) -> LocalSandbox:
        problem = await asyncio.to_thread(isolation_problem)
        if problem:
            raise RuntimeError(f"LocalSandbox: {problem}; commands are never run without network isolation")
        self.root = Path(tempfile.mkdtemp(prefix="slime-sandbox-"))
        os.chmod(self.root, 0o1777)  # root's own: the command cannot replace what is in it
        self._own(self._host_path("."), make_dir=True)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await asyncio.to_thread(self._kill_leftovers)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _kill_leftovers(self) -> None:
        marker = f"SLIME_SANDBOX_ID={self.sandbox_id}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    found = marker in f.read().split(b"\0")
                if found:
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    def _host_path(self, sandbox_path: str) -> Path:
        if self.root is None:
            raise RuntimeError("LocalSandbox is used outside its `async with`")
        p = PurePosixPath(sandbox_path)
        rel = p.relative_to("/tmp") if p.is_absolute() and p.is_relative_to("/tmp") else None
        if rel is None and p.is_absolute():
            raise ValueError(f"{sandbox_path!r}: a LocalSandbox path is under /tmp or relative to {WORKDIR}")
        host = (self.root / rel if rel is not None else self.root / "work" / p).resolve()
        if not host.is_relative_to(self.root.resolve()):
            raise ValueError(f"{sandbox_path!r} leaves the sandbox")
        return host

    def _own(self, path: Path, make_dir: bool = False) -> None:
        if make_dir:
            path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # the command runs as nobody: what slime writes for it must be its own
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> tuple[int, str, str]:
        """(exit code, stdout, stderr). `user` and `idempotent` are part of the contract and change nothing
        here: every command runs as the one sandbox user, and nothing is retried."""
        if self.root is None:
            raise RuntimeError("LocalSandbox is used outside its `async with`")
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": WORKDIR, "TMPDIR": "/tmp",
                    "LANG": "C.UTF-8", **self.base_env, **(env or {}), "SLIME_SANDBOX_ROOT": str(self.root),
                    "SLIME_SANDBOX_ID": self.sandbox_id, "SLIME_SANDBOX_DROP": str(int(os.geteuid() == 0))}
        proc = await asyncio.create_subprocess_exec(
            *_namespace_prefix(), "bash", "-c", _LAUNCHER, "sandbox", cmd, env=full_env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        out, err = _Capped(proc.stdout, self.max_output_bytes), _Capped(proc.stderr, self.max_output_bytes)
        limit = timeout if timeout else self.default_timeout
        try:
            code = await asyncio.wait_for(proc.wait(), limit)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            code = EXIT_TIMEOUT
        # a detached child may hold the pipes open: what came by now is the output
        await asyncio.wait([out.task, err.task], timeout=0.5)
        for reader in (out, err):
            reader.task.cancel()
        stderr = err.text() + (f"\n[killed after {limit} s]" if code == EXIT_TIMEOUT else "")
        if check and code != 0:
            raise RuntimeError(f"sandbox exec failed (exit={code}): {cmd[:120]}\n{stderr[:400]}")
        return code, out.text(), stderr

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        host = self._host_path(sandbox_path)
        for parent in reversed(host.relative_to(self.root.resolve()).parents[:-1]):  # not the root itself
            self._own(self.root.resolve() / parent, make_dir=True)
        if isinstance(content, Path):
            await asyncio.to_thread(shutil.copyfile, content, host)
        else:
            data = content.encode() if isinstance(content, str) else bytes(content)
            await asyncio.to_thread(host.write_bytes, data)
        self._own(host)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text ("" when it does not exist, as upstream's)."""
        try:
            return (await asyncio.to_thread(self._host_path(sandbox_path).read_bytes)).decode(errors="replace")
        except (FileNotFoundError, IsADirectoryError):
            return ""
