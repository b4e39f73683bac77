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
    # An engine over several processes (placement_group.engine_parts): SGLang one per node (--nnodes), the
    # embedded engine one per device (--tp-size); part 0 serves HTTP and starts the others (start_part).
    nnodes: int = 1
    node_rank: int = 0
    startup_timeout: float = 900.0
    max_running_requests: int | None = None
    context_length: int | None = None
    dtype: str | None = None
    random_seed: int | None = None
    sglang_args: list[str] = field(default_factory=list)
    memory_saver: bool = False
    deterministic: bool = False  # embedded: --sglang-enable-deterministic-inference (SGLang reads it from sglang_args)


class RolloutEngineActor:
    def __init__(self, spec: EngineSpec, parts: list | None = None) -> None:
        from slime.utils.net import free_port

        self.spec = spec
        self.parts = list(parts or [])  # actors of node ranks 1.. (part 0 only)
        if len(self.parts) != (spec.nnodes - 1 if spec.node_rank == 0 else 0):
            raise ValueError(f"engine {spec.index} over {spec.nnodes} processes got {len(self.parts)} other parts")
        self.port = free_port()
        # part 0's rendezvous host:port, picked at each start (every start builds the command again with it; the
        # placeholder only lets a not yet started multi-part server be described)
        self.dist_init_addr = "127.0.0.1:0"
        self.server = self._build(self.port)

    def _build(self, port: int):
        from slime.backends.sglang.process import ServerProcess

        s = self.spec
        part = f"-node{s.node_rank}" if s.node_rank else ""
        log = os.path.join(s.log_dir, f"engine-{s.index}{part}.log")
        from slime.utils.net import bind_host

        host = bind_host()
        url = f"http://{host}:{port}"
        if s.kind == "sglang":
            from slime.backends.sglang.launcher import SGLangLaunchSpec, sglang_command, sglang_env

            launch = SGLangLaunchSpec(model_path=s.model_path, port=port, tp_size=s.tp_size, device_ids=s.device_ids,
                                      token=s.token, extra_args=s.sglang_args, memory_saver=s.memory_saver, host=host,
                                      nnodes=s.nnodes, node_rank=s.node_rank, dist_init_addr=self.dist_init_addr)
            cmd, env = sglang_command(launch), sglang_env(launch)
        elif s.kind == "embedded":
            from slime.backends.embedded.launcher import embedded_command, embedded_env

            cmd = embedded_command(s.model_path, port, s.max_running_requests, s.context_length, s.dtype, s.random_seed,
                                   host=host, deterministic=s.deterministic)
            if s.nnodes > 1:  # one process per device: this one is TP rank node_rank
                cmd += ["--tp-size", str(s.nnodes), "--tp-rank", str(s.node_rank),
                        "--dist-init-addr", self.dist_init_addr]
            env = embedded_env(s.token, device_ids=s.device_ids)
        else:
            raise ValueError(f"unknown rollout engine kind {s.kind!r}; use embedded or sglang")
        return ServerProcess(name=f"rollout engine {s.index}", cmd=cmd, env=env, log_path=log, url=url)

    def start(self, attempts: int = 3) -> str:
        """Start and wait for /health. The port was free when picked but another process may take it
        before the server binds: then pick another port and try again."""
        from slime.backends.sglang.process import EngineStartError

        if self.spec.node_rank:
            raise ValueError(f"engine {self.spec.index} node rank {self.spec.node_rank} is started by its part 0")
        for attempt in range(attempts):
            if self.parts:
                self._start_parts()
            self.server.start()
            try:
                self.server.wait_healthy(self.spec.startup_timeout, self.spec.token)
                return self.server.url
            except EngineStartError as e:
                # a port found free was taken before the engine bound it (its HTTP port, or the rendezvous port
                # of an engine over several processes: torch's "EADDRINUSE ... address already in use")
                if "address already in use" not in str(e).lower() or attempt == attempts - 1:
                    raise
                self._move_to_free_port()
        raise AssertionError("unreachable")

    def _start_parts(self) -> None:
        """A fresh rendezvous address on this node (part 0's), then the other parts' processes with it."""
        import ray

        from slime.utils.net import bind_host, free_port

        host = bind_host()
        self.dist_init_addr = f"{host}:{free_port(host)}"
        starts = self.server.starts
        self.server = self._build(self.port)
        self.server.starts = starts
        ray.get([p.start_part.remote(self.dist_init_addr) for p in self.parts])

    def start_part(self, dist_init_addr: str) -> None:
        """Node rank > 0: start this part's process, joining part 0 at `dist_init_addr` (it serves no HTTP)."""
        self.server.stop()
        self.dist_init_addr = dist_init_addr
        starts = self.server.starts
        self.server = self._build(self.port)
        self.server.starts = starts
        self.server.start()

    def _stop_parts(self) -> None:
        import ray

        ray.get([p.stop.remote() for p in self.parts])

    def _move_to_free_port(self) -> None:
        """Rebuild the (stopped) server on a fresh port, keeping its start count for reports."""
        from slime.utils.net import free_port

        starts = self.server.starts
        self.port = free_port()
        self.server = self._build(self.port)
        self.server.starts = starts

    def url(self) -> str:
        return self.server.url

    def memory_is_host(self) -> bool:
        """Whether this engine's device memory is the host's (asked here, where the engine's devices are
        visible): then releasing and resuming it between rollouts hands no device memory to the trainer."""
        from slime.accelerator import get_accelerator

        return bool(get_accelerator().memory_is_host())

    def status(self) -> dict[str, Any]:
        return {"running": self.server.running(), "exit_code": self.server.exit_code(), "pid": self.server.pid,
                "starts": self.server.starts, "url": self.server.url, "log": self.server.log_path}

    def describe_exit(self) -> str:
        return self.server.describe_exit()

    def restart(self) -> str:
        """Stop whatever is left, start again on the same port when it is free (else a new one)."""
        from slime.backends.sglang.process import wait_port_free

        self.server.stop()
        self._stop_parts()
        if not wait_port_free(self.port):
            self._move_to_free_port()
        return self.start()

    def kill(self) -> int | None:
        """Fault injection: SIGKILL the server (tests). Returns its exit code."""
        self.server.kill()
        return self.server.exit_code()

    def stop(self) -> int | None:
        code = self.server.stop()
        self._stop_parts()
        return code
