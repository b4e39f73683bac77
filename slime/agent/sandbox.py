"""Sandboxes for agent rollouts (upstream slime's `slime.agent.sandbox` contract): an async context with
`exec`, `write_file` and `read_file`, on which harnesses and task code build.

Two backends: `LocalSandbox` (slime.agent.local_sandbox: local subprocesses without network, time and
output limits, a temporary working directory) and `E2BSandbox` (upstream's provider, a remote E2B
sandbox through the `e2b` package, which is installed separately).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from slime.agent.local_sandbox import LocalSandbox

logger = logging.getLogger(__name__)

__all__ = ["E2BSandbox", "LocalSandbox", "Sandbox", "ensure_agent_user", "exec_and_wait"]

ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path
EXIT_TIME_BUDGET_EXCEEDED = -1
DONE_MARKER_POLL_SEC = 5.0  # upstream's: short idempotent polls that also keep a remote sandbox alive


@runtime_checkable
class Sandbox(Protocol):
    """`write_file` takes text, bytes or a host file's Path. `idempotent` tells a backend that retries
    transport failures whether sending the command again is safe."""

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type, exc, tb) -> None: ...

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


async def _await_done_marker(sb: Sandbox, done_file: str, *, user: str, time_budget_sec: int) -> int:
    """The exit code a detached command wrote to `done_file`, or EXIT_TIME_BUDGET_EXCEEDED."""
    deadline = time.time() + time_budget_sec
    while time.time() < deadline:
        await asyncio.sleep(DONE_MARKER_POLL_SEC)
        code, out, _ = await sb.exec(f"test -f {done_file} && cat {done_file}", user=user, timeout=15, check=False)
        if code == 0 and (out or "").strip():
            return int(out.strip())
    return EXIT_TIME_BUDGET_EXCEEDED


async def exec_and_wait(sb: Sandbox, *, cmd: str, time_budget_sec: int, tag: str, user: str = "root",
                        env: dict[str, str] | None = None, workdir: str | None = None, out_file: str | None = None,
                        want_output: bool = False) -> tuple[int, str]:
    """Runs a long command detached (setsid, output to a file, exit code to /tmp/.{tag}.done) and polls for
    its end, so no request stays open for the command's whole run; (exit code, output): the whole output
    with `want_output`, else its last 512 bytes when the command failed, else "". Every step is a short
    request that may be sent twice: the spawn is guarded by a lock directory, cleared (with the previous
    run's markers) first. Two calls with one tag must not overlap."""
    out_file = out_file or f"/tmp/.{tag}.out"
    done_file, launcher, lock_dir = f"/tmp/.{tag}.done", f"/tmp/.{tag}.sh", f"/tmp/.{tag}.spawned"
    setup = f"cd {workdir}\nexport HOME=/home/{user}\n" if workdir else ""
    await sb.write_file(launcher, f"#!/bin/bash\n{setup}{cmd}\necho $? > {done_file}\n", user=user)
    await sb.exec(f"rm -rf {lock_dir}; rm -f {out_file} {done_file}", user=user, timeout=30, check=True,
                  idempotent=True)
    await sb.exec(f"chmod +x {launcher}; mkdir {lock_dir} 2>/dev/null || exit 0; "
                  f"setsid bash {launcher} < /dev/null > {out_file} 2>&1 &",
                  user=user, env=env, timeout=30, check=True, idempotent=True)
    code = await _await_done_marker(sb, done_file, user=user, time_budget_sec=time_budget_sec)
    if want_output:
        return code, await sb.read_file(out_file, user=user)
    if code == 0:
        return code, ""
    _, tail, _ = await sb.exec(f"tail -c 512 {out_file} 2>/dev/null", user=user, timeout=15, check=False)
    return code, tail or ""


def _getenv(*names: str, default: str = "") -> str:
    """The first of `names` set to a non-blank value (canonical name first, legacy aliases after)."""
    return next((os.environ[n] for n in names if (os.environ.get(n) or "").strip()), default)


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """The unprivileged `agent` user owning `workdir` (a remote image's setup; a LocalSandbox already runs
    its commands unprivileged and has no user to add)."""
    await sb.exec(f"id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && "
                  f"chown -R agent:agent /home/agent {workdir} && "
                  f"git config --system --add safe.directory '*' && id agent", user="root", check=True, timeout=60)



class E2BSandbox:
    """A remote E2B sandbox (`e2b.AsyncSandbox`) from an image, chosen through the gateway's metadata key
    (SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY). Transient transport failures are retried with jittered
    exponential backoff, a non-idempotent command never. Needs the `e2b` package and an E2B gateway."""

    image_metadata_key_env = ("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY")
    lifetime_sec_env = ("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "SWE_SANDBOX_LIFETIME_SEC")
    rpc_retries_env = ("SLIME_AGENT_SANDBOX_RPC_RETRIES", "SWE_RPC_RETRIES")
    size_env = ("SLIME_AGENT_E2B_SANDBOX_SIZE", "SWE_E2B_SANDBOX_SIZE")
    default_lifetime_sec = 3600
    default_rpc_retries = 6
    default_size = "md"
    rpc_backoff_base_sec = 1.0
    rpc_backoff_cap_sec = 32.0
    _TRANSIENT_RPC_ERRORS = frozenset({"ProtocolError", "LocalProtocolError", "WriteError", "ReadError",
                                       "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout",
                                       "PoolTimeout", "RemoteProtocolError", "SSLError"})

    def __init__(self, image: str, *, timeout: int | None = None, image_metadata_key: str | None = None,
                 rpc_retries: int | None = None, size: str | None = None) -> None:
        self.image = image
        self.timeout = timeout if timeout is not None else self._lifetime_sec_from_env()
        self.image_metadata_key = image_metadata_key or self._image_metadata_key_from_env()
        self.rpc_retries = rpc_retries if rpc_retries is not None else self._rpc_retries_from_env()
        self.size = size if size is not None else self._size_from_env()
        self._sb = None
        self.sandbox_id = ""

    @classmethod
    def _image_metadata_key_from_env(cls) -> str | None:
        return _getenv(*cls.image_metadata_key_env) or None

    @classmethod
    def _lifetime_sec_from_env(cls) -> int:
        return int(_getenv(*cls.lifetime_sec_env, default=str(cls.default_lifetime_sec)))

    @classmethod
    def _rpc_retries_from_env(cls) -> int:
        return int(_getenv(*cls.rpc_retries_env, default=str(cls.default_rpc_retries)))

    @classmethod
    def _size_from_env(cls) -> str:
        return _getenv(*cls.size_env, default=cls.default_size)

    @classmethod
    def _is_transient_rpc_error(cls, e: BaseException) -> bool:
        name = type(e).__name__
        if name == "SandboxException":  # the sandbox is gone: retrying cannot help
            return "does not exist" not in str(e) and "STOPPED state" not in str(e)
        return name in cls._TRANSIENT_RPC_ERRORS

    async def _rpc_retry(self, op_name: str, coro_factory, *, idempotent: bool = True):
        for attempt in range(self.rpc_retries):
            try:
                return await coro_factory()
            except Exception as e:
                if not idempotent or not self._is_transient_rpc_error(e) or attempt + 1 >= self.rpc_retries:
                    raise
                await self._reset_conn_pool()
                delay = random.uniform(0.0, min(self.rpc_backoff_cap_sec, self.rpc_backoff_base_sec * 2 ** attempt))
                logger.debug("[agent.sandbox] %s: %s, retry %d/%d in %.1f s", op_name, type(e).__name__,
                             attempt + 1, self.rpc_retries, delay)
                await asyncio.sleep(delay)
        raise RuntimeError(f"{op_name}: rpc_retries is {self.rpc_retries}; it must be at least 1")

    async def _reset_conn_pool(self) -> None:
        """Closes the client's connection pool so the next request reconnects."""
        try:
            await self._sb._transport.pool.aclose()  # e2b exposes no public handle on its httpcore pool
        except Exception as e:  # noqa: BLE001 - a fresh request reconnects anyway
            logger.debug("[agent.sandbox] conn-pool reset skipped: %s", e)

    async def __aenter__(self) -> E2BSandbox:
        if self.image_metadata_key is None:
            raise RuntimeError("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY is not set: export the metadata key your E2B "
                               "gateway routes images by (SWE_SANDBOX_IMAGE_METADATA_KEY is read too)")
        try:
            from e2b import AsyncSandbox
        except ImportError as e:
            raise RuntimeError("E2BSandbox needs the e2b package (pip install e2b); LocalSandbox runs "
                               "commands on this host instead") from e
        metadata = {self.image_metadata_key: self.image}
        if self.size:
            prefix = self.image_metadata_key.rsplit("/", 1)[0] if "/" in self.image_metadata_key else ""
            metadata[f"{prefix}/size" if prefix else "size"] = self.size
        self._sb = await self._rpc_retry("create", lambda: AsyncSandbox.create(timeout=self.timeout, metadata=metadata))
        self.sandbox_id = self._sb.sandbox_id
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if self._sb is not None:
                await self._sb.kill()
        except Exception as e:  # noqa: BLE001 - the gateway reclaims it at its lifetime
            logger.warning("[agent.sandbox] kill %s failed: %s", self.sandbox_id[:8], e)

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult:
        from e2b.sandbox.commands.command_handle import CommandExitException

        def run():
            return self._sb.commands.run(cmd, user=user, envs=env, timeout=timeout, on_stdout=lambda s: None,
                                         on_stderr=lambda s: None)
        try:
            res = await self._rpc_retry(f"exec({cmd[:60]!r})", run, idempotent=idempotent)
        except CommandExitException as e:
            if check:
                raise RuntimeError(f"e2b exec failed (exit={e.exit_code}): {cmd[:120]}\n{(e.stderr or '')[:400]}") \
                    from None
            return e.exit_code, e.stdout or "", e.stderr or ""
        return res.exit_code, res.stdout or "", res.stderr or ""

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        if isinstance(content, (Path, bytes)):
            async def write_stream():
                stream = open(content, "rb") if isinstance(content, Path) else io.BytesIO(content)
                with stream:
                    await self._sb.files.write(sandbox_path, stream, user=user, gzip=False, use_octet_stream=True,
                                               request_timeout=600)
            await self._rpc_retry(f"write_file({sandbox_path})", write_stream)
            return
        await self._rpc_retry(f"write_file({sandbox_path})", lambda: self._sb.files.write(sandbox_path, content,
                                                                                           user=user))

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        try:
            return await self._rpc_retry(f"read_file({sandbox_path})",
                                         lambda: self._sb.files.read(sandbox_path, user=user))
        except Exception:  # noqa: BLE001 - upstream's contract: a missing or unreadable file reads as ""
            return ""
