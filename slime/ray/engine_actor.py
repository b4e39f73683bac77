"""A Ray actor that owns one rollout engine server process (SGLang or embedded) on its devices.

The actor holds the engine's placement (device bundle); the server is its child process, so a
crashed server leaves the actor alive to report the exit code and log tail and to restart it on
the same port (the URL the trainer knows stays valid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineSpec:
    index: int
    kind: str  # "embedded" | "sglang"
    model_path: str
    token: str
    log_dir: str
    tp_size: int = 1
    device_ids: list[int] = field(default_factory=list)  # empty: use what the actor's environment gives
    startup_timeout: float = 900.0
    max_running_requests: int | None = None
    context_length: int | None = None
    dtype: str | None = None
    random_seed: int | None = None
    sglang_args: list[str] = field(default_factory=list)
    memory_saver: bool = False
    deterministic: bool = False  # embedded: --sglang-enable-deterministic-inference (SGLang reads it from sglang_args)


class RolloutEngineActor:
    def __init__(self, spec: EngineSpec) -> None:
        from slime.utils.net import free_port

        self.spec = spec
        self.port = free_port()
        self.server = self._build(self.port)

    def _build(self, port: int):
        from slime.backends.sglang.process import ServerProcess

        s = self.spec
        log = os.path.join(s.log_dir, f"engine-{s.index}.log")
        from slime.utils.net import bind_host

        host = bind_host()
        url = f"http://{host}:{port}"
        if s.kind == "sglang":
            from slime.backends.sglang.launcher import SGLangLaunchSpec, sglang_command, sglang_env

            launch = SGLangLaunchSpec(model_path=s.model_path, port=port, tp_size=s.tp_size, device_ids=s.device_ids,
                                      token=s.token, extra_args=s.sglang_args, memory_saver=s.memory_saver, host=host)
            cmd, env = sglang_command(launch), sglang_env(launch)
        elif s.kind == "embedded":
            from slime.backends.embedded.launcher import embedded_command, embedded_env

            cmd = embedded_command(s.model_path, port, s.max_running_requests, s.context_length, s.dtype, s.random_seed,
                                   host=host, deterministic=s.deterministic)
            env = embedded_env(s.token, device_ids=s.device_ids)
        else:
            raise ValueError(f"unknown rollout engine kind {s.kind!r}; use embedded or sglang")
        return ServerProcess(name=f"rollout engine {s.index}", cmd=cmd, env=env, log_path=log, url=url)

    def start(self, attempts: int = 3) -> str:
        """Start and wait for /health. The port was free when picked but another process may take it
        before the server binds: then pick another port and try again."""
        from slime.backends.sglang.process import EngineStartError

        for attempt in range(attempts):
            self.server.start()
            try:
                self.server.wait_healthy(self.spec.startup_timeout, self.spec.token)
                return self.server.url
            except EngineStartError as e:
                if "Address already in use" not in str(e) or attempt == attempts - 1:
                    raise
                self._move_to_free_port()
        raise AssertionError("unreachable")

    def _move_to_free_port(self) -> None:
        """Rebuild the (stopped) server on a fresh port, keeping its start count for reports."""
        from slime.utils.net import free_port

        starts = self.server.starts
        self.port = free_port()
        self.server = self._build(self.port)
        self.server.starts = starts

    def url(self) -> str:
        return self.server.url

    def status(self) -> dict[str, Any]:
        return {"running": self.server.running(), "exit_code": self.server.exit_code(), "pid": self.server.pid,
                "starts": self.server.starts, "url": self.server.url, "log": self.server.log_path}

    def describe_exit(self) -> str:
        return self.server.describe_exit()

    def restart(self) -> str:
        """Stop whatever is left, start again on the same port when it is free (else a new one)."""
        from slime.backends.sglang.process import wait_port_free

        self.server.stop()
        if not wait_port_free(self.port):
            self._move_to_free_port()
        return self.start()

    def kill(self) -> int | None:
        """Fault injection: SIGKILL the server (tests). Returns its exit code."""
        self.server.kill()
        return self.server.exit_code()

    def stop(self) -> int | None:
        return self.server.stop()
