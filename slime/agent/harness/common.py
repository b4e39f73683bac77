"""A coding agent's CLI in a sandbox (upstream slime's `slime.agent.harness.common` contract).

A harness installs its CLI (`install_cli`), writes its configuration (`write_config`) and runs it on a prompt
against an adapter URL, with the session id as the CLI's API key (`launch_and_wait`); `run` is that
sequence after creating the sandbox's `agent` user. The task itself (preparing the workspace, scoring the
result) is the caller's. `install_npm_cli` and `run_agent` cover npm-packaged CLIs run to completion.
"""

from __future__ import annotations

import asyncio
import lzma
import os
import shutil
import tempfile
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from slime.agent import sandbox as _sandbox
from slime.agent.sandbox import Sandbox, exec_and_wait
from slime.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3  # in-sandbox retries of a flaky global install, cheaper than a new sandbox
NPM_INSTALL_BACKOFF_SEC = 2.0


class SingletonABCMeta(ABCMeta, SingletonMeta):
    """One instance per harness class (they hold no per-run state)."""


@dataclass(frozen=True)
class HarnessContext:
    """What a harness run needs; `model_label` is the model name the CLI is told (the adapter serves
    whatever the engines hold)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    name: str = ""  # claude_code, codex, ...

    @abstractmethod
    async def install_cli(self, sb: Sandbox) -> None:
        """Installs the CLI in the sandbox."""

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Writes the CLI's configuration files."""

    @abstractmethod
    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        """Runs the agent to its end; its exit code (EXIT_TIME_BUDGET_EXCEEDED past the budget)."""

    async def run(self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: int,
                  prompt: str) -> int:
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


async def run_agent(sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int) -> int:
    """`start_cmd` as the agent user in `workdir`, detached (exec_and_wait), its output in
    {workdir}/.harness/trajectory.jsonl; its exit code."""
    meta_dir = f"{workdir}/.harness"
    await sb.exec(f"mkdir -p {meta_dir} && chown agent:agent {meta_dir}", user="root", check=True, timeout=30)
    code, _ = await exec_and_wait(sb, cmd=start_cmd, user="agent", env=env, workdir=workdir,
                                  out_file=f"{meta_dir}/trajectory.jsonl", time_budget_sec=time_budget_sec, tag="run",
                                  want_output=False)
    return code


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path, npm_package: Path, check_cmd: str) -> None:
    """Node 22, then the CLI's npm package installed globally and checked with `check_cmd`, retried
    NPM_INSTALL_RETRIES times; RuntimeError with the install's log tail when every try fails."""
    await install_node22(sb, node_runtime)
    await sb.write_file("/tmp/harness-cli.tgz", npm_package)
    cmd = "npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && " + check_cmd
    for attempt in range(NPM_INSTALL_RETRIES):
        code, log = await exec_and_wait(sb, cmd=cmd, user="root", time_budget_sec=300, tag="harness-npm-install")
        if code == 0:
            return
        if attempt + 1 < NPM_INSTALL_RETRIES:
            await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * (attempt + 1))
    raise RuntimeError(f"npm install failed after {NPM_INSTALL_RETRIES} attempts (exit={code}):\n{log[-1000:]}")


async def install_node22(sb: Sandbox, host_tarball: Path) -> None:
    """Node 22 from a host tarball over the image's own; a .xz tarball is unpacked on the host once (cached
    in the temp dir), since images may lack xz."""
    host_tarball = Path(host_tarball)
    if host_tarball.suffix == ".xz":
        plain = Path(tempfile.gettempdir()) / f"coding_agent_rl.{host_tarball.stem}.tar"
        if not plain.exists():
            partial = plain.with_suffix(".tar.partial")
            with lzma.open(host_tarball, "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, plain)
        host_tarball = plain
    await sb.write_file("/tmp/node22.tar", host_tarball)
    links = " && ".join(f"ln -sf /opt/node22/bin/{b} /usr/local/bin/{b}" for b in ("node", "npm", "npx"))
    await sb.exec("set -e && mkdir -p /opt/node22 && tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1 && "
                  f"{links} && hash -r 2>/dev/null || true && node --version && npm --version",
                  user="root", timeout=180, check=True)
