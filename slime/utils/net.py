"""Small network helpers shared by the trainer, the engines and their launchers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now ("" = every interface, for rendezvous other nodes reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


LOOPBACK = "127.0.0.1"


def bind_host() -> str:
    """Where engine and router servers listen: 127.0.0.1 in a single-node run, this node's address when the
    Ray cluster has more than one node (the trainer and the router may then be elsewhere). Weight and
    control endpoints keep their bearer token either way. `SLIME_BIND_HOST` overrides."""
    import os

    if os.environ.get("SLIME_BIND_HOST"):
        return os.environ["SLIME_BIND_HOST"]
    try:
        import ray

        if ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return LOOPBACK


def node_ip() -> str:
    """This node's address as Ray tells it (where other nodes reach a store this process hosts); 127.0.0.1
    when Ray cannot tell."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return LOOPBACK
