"""The `python -m sglang.launch_server` command line and environment for an engine on the current
accelerator. Device flags come from the accelerator (`sglang_server_args()`); visible devices and collective settings from
`Accelerator.worker_env`. User flags (--sglang-*) come last and win over defaults.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from slime.accelerator import get_accelerator

HOST = "127.0.0.1"


@dataclass
class SGLangLaunchSpec:
    model_path: str
    port: int
    tp_size: int = 1
    device_ids: list[int] = field(default_factory=list)
    token: str | None = None  # served as --api-key: every endpoint then needs "Authorization: Bearer <token>"
    extra_args: list[str] = field(default_factory=list)  # from --sglang-* flags
    memory_saver: bool = False  # release/resume_memory_occupation (colocated training)
    host: str = HOST  # slime.utils.net.bind_host(): the node's address in a multi-node run
    # An engine spanning nodes (SGLang's --nnodes/--node-rank/--dist-init-addr): one server per node, node 0 serves
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def device_flags(acc: Any) -> list[str]:
    return list(acc.sglang_server_args())


def _drop_overridden(defaults: list[str], user: list[str]) -> list[str]:
    """Remove `--flag value` pairs from defaults when the user passes the same flag."""
    given = {a.split("=", 1)[0] for a in user if a.startswith("--")}
    out, i = [], 0
    while i < len(defaults):
        flag = defaults[i]
        has_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("--")
        if flag not in given:
            out += defaults[i:i + 1 + has_value]
        i += 1 + has_value
    return out


def sglang_command(spec: SGLangLaunchSpec, acc: Any = None, python: str = sys.executable) -> list[str]:
    acc = acc or get_accelerator()
    if spec.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {spec.tp_size}")
    defaults = ["--model-path", spec.model_path, "--host", spec.host, "--port", str(spec.port),
                "--tp-size", str(spec.tp_size)] + device_flags(acc)
    if spec.nnodes > 1:
        if not spec.dist_init_addr:
            raise ValueError(f"an engine over {spec.nnodes} nodes needs dist_init_addr (node 0's host:port)")
        defaults += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                     "--dist-init-addr", spec.dist_init_addr]
    if spec.token:
        defaults += ["--api-key", spec.token]
    if spec.memory_saver:
        defaults.append("--enable-memory-saver")
    return [python, "-m", "sglang.launch_server"] + _drop_overridden(defaults, spec.extra_args) + list(spec.extra_args)


def sglang_env(spec: SGLangLaunchSpec, acc: Any = None, base: dict[str, str] | None = None) -> dict[str, str]:
    acc = acc or get_accelerator()
    env = dict(os.environ if base is None else base)
    if spec.device_ids:
        if len(spec.device_ids) * spec.nnodes != spec.tp_size:  # each node's server sees its own devices
            where = f" on this one of {spec.nnodes} nodes" if spec.nnodes > 1 else ""
            raise ValueError(f"engine has tp_size {spec.tp_size} but {len(spec.device_ids)} device ids "
                             f"{spec.device_ids}{where}")
        env.update({k: str(v) for k, v in acc.worker_env(spec.device_ids).items()})
    return env


def bind_host() -> str:
    from slime.utils.net import bind_host as _bind_host

    return _bind_host()
