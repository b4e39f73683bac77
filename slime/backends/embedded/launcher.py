"""Command line of the embedded engine as a child process (same process wrapper as SGLang's)."""

from __future__ import annotations

import os
import sys
from typing import Any

from slime.backends.embedded.__main__ import TOKEN_ENV


def embedded_command(model_path: str, port: int, max_running_requests: int | None = None,
                     context_length: int | None = None, dtype: str | None = None, random_seed: int | None = None,
                     python: str = sys.executable, host: str = "127.0.0.1", deterministic: bool = False) -> list[str]:
    cmd = [python, "-m", "slime.backends.embedded", "--model-path", model_path, "--port", str(port), "--host", host]
    for flag, value in (("--max-running-requests", max_running_requests), ("--context-length", context_length),
                        ("--dtype", dtype), ("--random-seed", random_seed)):
        if value is not None:
            cmd += [flag, str(value)]
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    return cmd


def embedded_env(token: str, acc: Any = None, device_ids: list[int] | None = None,
                 base: dict[str, str] | None = None) -> dict[str, str]:
    from slime.accelerator import get_accelerator

    acc = acc or get_accelerator()
    env = dict(os.environ if base is None else base)
    if device_ids:
        env.update({k: str(v) for k, v in acc.worker_env(device_ids).items()})
    env[TOKEN_ENV] = token  # not on the command line: argv is visible to every local user
    return env
