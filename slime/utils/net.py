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


def _routable_ip(family: int, probe_target: str) -> str | None:
    """This host's non-loopback address of `family`: the source address a UDP socket routed towards
    `probe_target` takes (no packet is sent), else the first non-loopback address the hostname resolves to."""
    def loopback(ip: str) -> bool:
        return ip.startswith("127.") or ip == "::1"

    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe_target, 80))
            if not loopback(s.getsockname()[0]):
                return s.getsockname()[0]
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, family=family, type=socket.SOCK_STREAM):
            if not loopback(info[4][0]):
                return info[4][0]
    except OSError:
        pass
    return None


def get_host_info() -> tuple[str, str]:
    """(hostname, this host's address) as upstream slime's http_utils gives them: `SLIME_HOST_IP` when set; else
    the routable IPv4 address (IPv6 only with `SLIME_PREFER_IPV6`, never mixed), falling back to the loopback."""
    import os

    hostname = socket.gethostname()
    if os.getenv("SLIME_HOST_IP"):
        return hostname, os.environ["SLIME_HOST_IP"]
    if os.getenv("SLIME_PREFER_IPV6", "0").lower() in ("1", "true", "yes", "on"):
        return hostname, _routable_ip(socket.AF_INET6, "2001:4860:4860::8888") or "::1"
    return hostname, _routable_ip(socket.AF_INET, "8.8.8.8") or LOOPBACK
