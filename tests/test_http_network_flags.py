"""--http-proxy and --use-distributed-post (upstream's network flags) on slime.utils.http_utils, the HTTP client of
plugins' rollouts and of remote rewards: the proxy carries requests to other servers (never the run's router or
engines); distributed posts go out from Ray actors pinned to the nodes, in turn, falling back to this process."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from slime.utils import http_utils
from tests.json_http import JsonHandler, serve

REFUSED_PORT = "http://127.0.0.1:1"  # nothing listens: only a proxy can answer for it


class _Proxy(JsonHandler):
    seen: list = []

    def do_POST(self):
        _Proxy.seen.append((self.path, self.headers.get("Host"), self.body()))
        self.reply(200, {"via": "proxy", "target": self.path})


class _Direct(JsonHandler):
    seen: list = []

    def do_POST(self):
        _Direct.seen.append((self.path, self.body()))
        self.reply(200, {"via": "direct", "pid": os.getpid()})


@pytest.fixture
def servers(monkeypatch):
    monkeypatch.setattr(http_utils, "RETRY_INTERVAL_S", 0.01)
    _Proxy.seen, _Direct.seen = [], []
    proxy, proxy_url = serve(_Proxy)
    router, router_url = serve(_Direct)
    yield proxy_url, router_url
    for s in (proxy, router):
        s.shutdown()
    http_utils.init_http_client(SimpleNamespace())  # back to no proxy, no posters


def _args(router_url, **kw):
    host, port = router_url.removeprefix("http://").split(":")
    return SimpleNamespace(sglang_router_ip=host, sglang_router_port=int(port), rollout_num_engines=1, **kw)


def test_proxy_carries_other_servers_requests_but_not_the_routers(servers):
    proxy_url, router_url = servers
    http_utils.init_http_client(_args(router_url, http_proxy=proxy_url))
    assert asyncio.run(http_utils.post(router_url + "/generate", {"x": 1}))["via"] == "direct"
    out = asyncio.run(http_utils.post(REFUSED_PORT + "/score?k=v", {"response": "r"}, max_retries=1))
    assert out == {"via": "proxy", "target": REFUSED_PORT + "/score?k=v"}  # the absolute URI, as proxies take it
    assert _Proxy.seen == [(REFUSED_PORT + "/score?k=v", "127.0.0.1:1", {"response": "r"})]
    assert _Direct.seen == [("/generate", {"x": 1})]
    http_utils.init_http_client(_args(router_url))  # no --http-proxy: the same request has nowhere to go
    with pytest.raises(OSError):
        asyncio.run(http_utils.post(REFUSED_PORT + "/score", {}, max_retries=1))


def test_remote_rm_goes_through_the_proxy(servers):
    from slime.rollout.rm_hub import remote_rm

    proxy_url, _ = servers
    args = SimpleNamespace(rm_url=REFUSED_PORT + "/rm", http_proxy=proxy_url)
    sample = SimpleNamespace(prompt="p", response="r", label="l")
    assert asyncio.run(remote_rm(args, sample, max_retries=1))["via"] == "proxy"
    assert _Proxy.seen[0][2] == {"prompt": "p", "response": "r", "label": "l"}


def test_proxy_flag_is_checked():
    from slime.config.rollout_args import RolloutArgumentError, rollout_defaults, validate_rollout_args

    assert rollout_defaults().http_proxy is None and rollout_defaults().use_distributed_post is False
    with pytest.raises(RolloutArgumentError, match="--http-proxy must look like http://host:port"):
        validate_rollout_args(rollout_defaults(http_proxy="socks5://127.0.0.1:1080"))
    from slime.config.upstream_differences import upstream_difference_warnings

    args = rollout_defaults(http_proxy="http://127.0.0.1:3128", use_critic=False)  # (use_critic: set by validation)
    warned = [w for w in upstream_difference_warnings(args) if "--http-proxy" in w]
    assert len(warned) == 1 and "reads it nowhere" in warned[0]  # the deliberate difference, one line at start


def test_distributed_post_spreads_posts_over_ray_actors_on_the_nodes(servers):
    import ray

    _, router_url = servers
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # a cluster of its own: a bare ray.init() joins the cluster another process on this machine recorded
        # (cluster_utils or `ray start`), and with num_cpus it then fails with "When connecting to an existing
        # cluster, num_cpus and num_gpus must not be provided"
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        http_utils.init_http_client(_args(router_url, use_distributed_post=True, actor_num_gpus_per_node=2,
                                          sglang_server_concurrency=4, max_concurrency=8))
        actors = http_utils.poster_actors()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(actors) == 2 * len(nodes)

        n = 2 * len(actors)  # two posts per actor, in turn (an earlier test's Ray may have several nodes)

        async def posts():
            return await asyncio.gather(*(http_utils.post(router_url + "/generate", {"i": i}) for i in range(n)))

        outs = asyncio.run(posts())
        stats = ray.get([a.stats.remote() for a in actors])
        assert [s["sent"] for s in stats] == [2] * len(actors) and {s["node_id"] for s in stats} == nodes
        assert sorted(b["i"] for _, b in _Direct.seen) == list(range(n))
        assert all(o["via"] == "direct" for o in outs) and len({o["pid"] for o in outs}) == 1  # the server's pid
        ray.kill(actors[0])  # a failing actor: its posts are sent from here (upstream's fallback)
        with pytest.raises(ray.exceptions.RayActorError):  # dead before the posts (kill is asynchronous)
            ray.get(actors[0].stats.remote(), timeout=60)
        assert asyncio.run(posts())
        assert len(_Direct.seen) == 2 * n
    finally:
        http_utils.stop_posters()
        if started:
            ray.shutdown()
