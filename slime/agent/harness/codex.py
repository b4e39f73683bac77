"""Codex (`codex exec`) as a harness, talking to the OpenAI adapter. The provider's base_url must be in
config.toml (Codex reads it from the environment only for its default provider); the file is written
through base64 so no shell quoting can garble it."""

from __future__ import annotations

import base64
import json
import os
import shlex
from pathlib import Path

from slime.agent.sandbox import Sandbox

from .common import BaseHarness, HarnessContext, install_npm_cli, run_agent


class CodexHarness(BaseHarness):
    name = "codex"
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"
    exec_flags = "--skip-git-repo-check"  # workdirs such as shallow clones fail Codex's git check
    config_toml = ('model = "{model}"\nmodel_provider = "slime"\n\n[model_providers.slime]\nname = "slime"\n'
                   'base_url = "{base_url}"\nenv_key = "OPENAI_API_KEY"\nwire_api = "chat"\n')

    async def install_cli(self, sb: Sandbox) -> None:
        await install_npm_cli(sb, node_runtime=Path(os.environ[self.node_tarball_env]),
                              npm_package=Path(os.environ[self.cli_tarball_env]), check_cmd="codex --version")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        toml = self.config_toml.format(model=ctx.model_label, base_url=f"{ctx.adapter_url}/v1")
        encoded = base64.b64encode(toml.encode()).decode("ascii")
        await sb.exec(f"mkdir -p /home/agent/.codex && echo {shlex.quote(encoded)} | base64 -d > "
                      "/home/agent/.codex/config.toml && chown -R agent:agent /home/agent/.codex",
                      user="root", check=True, timeout=60)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        cmd = f"codex exec {self.exec_flags} {shlex.quote(prompt)}"
        if extra := os.environ.get(self.extra_args_env, "").strip():
            cmd += f" {extra}"
        # Codex sends OPENAI_API_KEY as the bearer token: the adapter's session id
        env = {"OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1"}
        if extra_envs := os.environ.get(self.extra_envs_env, "").strip():
            env.update(json.loads(extra_envs))
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=cmd, env=env, time_budget_sec=time_budget_sec)
