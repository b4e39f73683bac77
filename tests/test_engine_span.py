"""Colocated rollout engines spanning nodes (upstream's GLM-5 / DeepSeek-R1 / Kimi-K2 scripts: 64-device engines on
8-device nodes). Placement splits an engine into one part per node (SGLang: --nnodes / --node-rank /
--dist-init-addr, node 0 serving HTTP) or per device (the embedded engine: one process per TP rank). On CPU, a Ray
cluster of two nodes on this machine runs one embedded engine at TP 2 across both: greedy tokens equal a
single-process engine's and log-probs within 1e-5 (float32), also after weight updates (from disk, and the
trainer's distributed path) that rank 0 broadcasts."""

from __future__ import annotations

import argparse
import functools
import json
import os
import urllib.request

import pytest

from slime.ray.placement_group import DeviceSlots


def _slots(nodes: list[str], device_ids: list[int], share: float = 0.2) -> DeviceSlots:
    return DeviceSlots(pg=None, bundle_indices=list(range(len(nodes))), device_ids=device_ids, node_ips=nodes,
                       cpus_per_bundle=1.0, share=share, node_ids=[f"id-{n}" for n in nodes])


def test_engine_parts_fill_whole_nodes():
    slots = _slots(["n0"] * 4 + ["n1"] * 4 + ["n2"] * 4 + ["n3"] * 4, [0, 1, 2, 3] * 4)
    parts = slots.engine_parts(1, 8)  # engine 1 of 8 devices: nodes n2 and n3, one server each
    assert [(p.node_ip, p.device_ids) for p in parts] == [("n2", [0, 1, 2, 3]), ("n3", [0, 1, 2, 3])]
    assert [p.options["scheduling_strategy"].placement_group_bundle_index for p in parts] == [8, 12]
    per_device = slots.engine_parts(0, 8, per_device=True)  # the embedded engine: a process per device
    assert [p.device_ids for p in per_device] == [[d] for d in [0, 1, 2, 3] * 2]
    assert [p.node_ip for p in slots.engine_parts(3, 4)] == ["n3"]  # within a node: one part
    with pytest.raises(ValueError, match="spans 2 nodes; place its parts with engine_parts"):
        slots.engine_options(0, 8)
    uneven = _slots(["n0"] * 3 + ["n1"] * 3, [0, 1, 2] * 2)
    with pytest.raises(ValueError, match=r"would span nodes \['n0', 'n1'\] with part of a node's devices"):
        uneven.engine_parts(0, 4)  # 3 + 1 devices: not whole nodes


def test_engine_larger_than_a_node_without_colocate(tmp_path, capsys):
    """Upstream's run-qwen3-235B-A22B.sh: 32-device engines on 8-device nodes, not colocated. No bundle holds 32
    devices, so the engines get a bundle per device and parts over whole nodes; a size that is neither a divisor
    nor a multiple of a node is one line before Ray starts."""
    from types import SimpleNamespace

    from slime.ray.placement_group import bundle_devices

    args = SimpleNamespace(actor_num_nodes=1, actor_num_gpus_per_node=8, rollout_num_gpus=64,
                           rollout_num_gpus_per_engine=32, colocate=False, debug_rollout_only=False, num_gpus_per_node=8)
    assert bundle_devices(args) == ([1] * 8 + [1] * 64, 8)
    # --num-gpus-per-node: the rollout's nodes may differ from the trainer's (upstream's flag)
    assert bundle_devices(SimpleNamespace(**{**vars(args), "rollout_num_gpus_per_engine": 8})) == ([1] * 8 + [8] * 8, 8)
    assert bundle_devices(SimpleNamespace(**{**vars(args), "rollout_num_gpus_per_engine": 8, "num_gpus_per_node": 4})) \
        == ([1] * 8 + [1] * 64, 8)
    rollout = _slots([f"n{1 + i // 8}" for i in range(64)], list(range(8)) * 8, share=1.0)
    parts = rollout.engine_parts(1, 32)
    assert [p.node_ip for p in parts] == ["n5", "n6", "n7", "n8"] and all(p.device_ids == list(range(8)) for p in parts)
    args.rollout_num_gpus_per_engine = 4
    assert bundle_devices(args) == ([1] * 8 + [4] * 16, 8)  # within a node: a bundle per engine, as before

    from test_upstream_scripts import _argv

    from slime.config.arguments import parse_args

    argv = _argv("run-qwen3-235B-A22B.sh", tmp_path)
    for flag, value in (("--rollout-num-gpus", "36"), ("--rollout-num-gpus-per-engine", "12")):
        argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert "--rollout-num-gpus-per-engine 12: an engine's devices must be on one node or fill whole nodes" in err


def test_nodes_of_one_host_are_told_apart_by_node_id():
    slots = _slots(["127.0.0.1"] * 2, [0, 0])  # two Ray nodes on one machine: same ip, different node ids
    parts = slots.engine_parts(0, 2, per_device=True)
    assert len(parts) == 2 and [p.options["scheduling_strategy"].placement_group_bundle_index for p in parts] == [0, 1]
    one_node = DeviceSlots(pg=None, bundle_indices=[0, 1], device_ids=[0, 1], node_ips=["h"] * 2, cpus_per_bundle=1,
                           share=0.2)
    assert len(one_node.engine_parts(0, 2)) == 1


def _sglang_parser() -> argparse.ArgumentParser:
    """`sglang.launch_server`'s own options, from the recorded option surface (slime/config/sglang_options.json)."""
    from slime.config.sglang_options import _kwargs, recorded_surface

    surface = recorded_surface("sglang")
    parser = argparse.ArgumentParser(exit_on_error=False)
    for o in surface.options:
        parser.add_argument(*[f"--{f}" for f in o.flags], dest=o.dest, **_kwargs(o, surface))
    return parser


@pytest.mark.parametrize("node_rank", [0, 1])
def test_sglang_launch_args_of_an_engine_over_two_nodes(node_rank):
    """Each node's server command parses with SGLang's own options: nnodes / node_rank typed int, dist_init_addr
    part 0's host:port, tp_size the whole engine; each node's environment names its own devices."""
    from slime.accelerator.cpu import CpuAccelerator
    from slime.backends.sglang.launcher import SGLangLaunchSpec, sglang_command, sglang_env

    spec = SGLangLaunchSpec("/m", 31000, tp_size=16, device_ids=list(range(8)), host=f"10.0.0.{4 + node_rank}",
                            nnodes=2, node_rank=node_rank, dist_init_addr="10.0.0.4:5000",
                            extra_args=["--mem-fraction-static", "0.7", "--ep-size", "16"])
    cmd = sglang_command(spec, CpuAccelerator(), python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    ns = _sglang_parser().parse_args(cmd[3:])
    assert (ns.nnodes, ns.node_rank, ns.dist_init_addr, ns.tp_size, ns.host, ns.port) == \
        (2, node_rank, "10.0.0.4:5000", 16, f"10.0.0.{4 + node_rank}", 31000)
    assert (ns.mem_fraction_static, ns.ep_size) == (0.7, 16)
    sglang_env(spec, CpuAccelerator(), base={})  # 8 devices on each of 2 nodes: tp 16
    with pytest.raises(ValueError, match=r"tp_size 16 but 16 device ids .* on this one of 2 nodes"):
        sglang_env(SGLangLaunchSpec("/m", 1, tp_size=16, device_ids=list(range(16)), nnodes=2,
                                    dist_init_addr="h:1"), CpuAccelerator(), base={})


def test_engine_actor_commands_of_each_part(tmp_path):
    """The engine actor of node rank r builds that part's command: SGLang with --nnodes / --node-rank and part 0's
    --dist-init-addr (parsed with SGLang's own options), the embedded engine with --tp-size / --tp-rank (parsed
    with its own parser); part 0 refuses to start without its other parts, a later part refuses to start alone."""
    from slime.backends.embedded.__main__ import parse_args as embedded_args
    from slime.ray.engine_actor import EngineSpec, RolloutEngineActor

    common = dict(index=3, model_path="/m", token="t", log_dir=str(tmp_path), tp_size=16, nnodes=2, node_rank=1)
    part = RolloutEngineActor(EngineSpec(kind="sglang", device_ids=list(range(8)), **common))
    part.dist_init_addr = "10.0.0.4:5000"
    ns = _sglang_parser().parse_args(part._build(31000).cmd[3:])
    assert (ns.nnodes, ns.node_rank, ns.dist_init_addr, ns.tp_size, ns.port) == (2, 1, "10.0.0.4:5000", 16, 31000)
    assert part._build(31000).log_path.endswith("engine-3-node1.log")
    with pytest.raises(ValueError, match="node rank 1 is started by its part 0"):
        part.start()
    follower = RolloutEngineActor(EngineSpec(kind="embedded", **{**common, "tp_size": 2}))
    follower.dist_init_addr = "10.0.0.4:5001"
    cmd = follower._build(31001).cmd
    got = embedded_args(cmd[cmd.index("-m") + 2:])
    assert (got.tp_size, got.tp_rank, got.dist_init_addr) == (2, 1, "10.0.0.4:5001")
    with pytest.raises(ValueError, match="over 2 processes got 0 other parts"):
        RolloutEngineActor(EngineSpec(kind="embedded", **{**common, "node_rank": 0}))


def _post(url: str, path: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


PROMPTS = [[5, 9, 33, 7, 101], [12, 40, 41], [300, 2, 2, 17, 60, 61, 9]]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@functools.lru_cache(maxsize=None)
def _single_process(ckpt: str) -> list[tuple[list[int], list[float]]]:
    from slime.backends.embedded import EmbeddedEngine, EngineConfig

    engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
    try:
        return [(r.output_ids, r.logprobs) for r in (engine.generate(p, GREEDY, True) for p in PROMPTS)]
    finally:
        engine.shutdown()


def _check_same(got: list[dict], want: list[tuple[list[int], list[float]]]) -> None:
    for g, (ids, lps) in zip(got, want):
        assert g["output_ids"] == ids
        got_lps = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lps, lps)) <= 1e-5, (got_lps, lps)


@pytest.mark.timeout(300)
def test_one_embedded_engine_over_two_ray_nodes(tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from slime.config.rollout_args import rollout_defaults, validate_rollout_args
    from slime.ray.placement_group import create_placement_groups
    from slime.ray.rollout_manager import RolloutManager
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    if ray.is_initialized():  # an earlier test's local Ray: this one needs its own two-node cluster
        ray.shutdown()
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), "glm_moe_dsa")
    other = write_tiny_checkpoint(str(tmp_path / "other"), "glm_moe_dsa", seed=7)
    args = validate_rollout_args(rollout_defaults(
        hf_checkpoint=ckpt, colocate=True, actor_num_nodes=2, actor_num_gpus_per_node=1, rollout_num_gpus=2,
        rollout_num_gpus_per_engine=2, rollout_engine="embedded", rollout_router="in-process",
        output_dir=str(tmp_path / "out")))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    manager = None
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        slots = create_placement_groups(args)["rollout"]
        assert len(set(slots.node_ids)) == 2  # one bundle on each Ray node
        manager = RolloutManager(args, slots)
        assert manager.n == 1 and manager.engines()[0]["tp_size"] == 2
        url, token = manager.urls[0], manager.token()
        _check_same(_post(url, "/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY, "return_logprob": True},
                          token), _single_process(ckpt))
        # a weight update reaches rank 1 (rank 0 broadcasts what it loaded): the other checkpoint's outputs
        assert _post(url, "/update_weights_from_disk", {"model_path": other}, token)["success"]
        _check_same(_post(url, "/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY, "return_logprob": True},
                          token), _single_process(other))
        follower = open(os.path.join(manager.log_dir, "engine-0-node1.log")).read()
        assert "embedded engine TP rank 1/2 following" in follower
        # the trainer's distributed path (this process as trainer rank 0): the engine joins with its rank 0 only
        from safetensors.torch import load_file

        from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync

        endpoint = EngineEndpoint.from_dict(manager.engines()[0])
        assert (endpoint.tp_size, endpoint.update_group_ranks) == (2, 1)
        named = sorted((n, t.float()) for n, t in load_file(os.path.join(ckpt, "model.safetensors")).items())
        sync = WeightSync("distributed", lambda: iter([named[i:i + 9] for i in range(0, len(named), 9)]), [endpoint],
                          rank=0, timeout_s=120)
        assert sync.sync(version=3)["weight_sync/checked_tensors"] == len(named)
        sync.close()
        _check_same(_post(url, "/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY, "return_logprob": True},
                          token), _single_process(ckpt))
    finally:
        if manager is not None:
            manager.shutdown()
        ray.shutdown()
        cluster.shutdown()
