"""Ray placement of trainer ranks and rollout engines on accelerator devices.

Trainer: one bundle per device, `{<accelerator ray resource>: 1, "CPU": c}` (GPU, NPU), or `{"CPU": c}`
when the accelerator has no Ray resource (CPU: a bundle is a worker slot). Colocated: the engines
share the trainer's bundles, each side taking a fraction of the device; split: one bundle per engine
after the trainer's, `{resource: devices per engine, "CPU": c}`, which the engine actor reserves whole.
Each bundle's device ids are probed once so workers can be pinned with `get_accelerator().worker_env(ids)`
(Ray's own visible-device setting is turned off there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from slime.accelerator import get_accelerator

# Shares of one device when colocated (trainer + engine on the same bundle); the rest is slack
# for the placement probe and helpers. Split placement gives each side the whole device.
TRAIN_SHARE_COLOCATED = 0.4
ROLLOUT_SHARE_COLOCATED = 0.2
# Ray refuses "CPU"/"GPU" inside `resources=`; they have their own options.
_RAY_BUILTIN_OPTION = {"CPU": "num_cpus", "GPU": "num_gpus"}


def device_request(amount: float) -> dict[str, Any]:
    """Ray `.options(...)` asking for `amount` of the accelerator's device resource ({} when it has none)."""
    resource = get_accelerator().ray_resource
    if resource is None:
        return {}
    key = _RAY_BUILTIN_OPTION.get(resource)
    return {key: amount} if key else {"resources": {resource: amount}}


@dataclass
class EnginePart:
    """One process group member of a rollout engine: its actor's `.options(**...)`, devices and node ip."""

    options: dict[str, Any]
    device_ids: list[int]
    node_ip: str


@dataclass
class DeviceSlots:
    """Bundles of one placement group given to one role (trainer or rollout)."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    bundle_indices: list[int]
    device_ids: list[int]  # accelerator ids of the bundles' devices on their nodes, bundle by bundle (0 for CPU slots)
    node_ips: list[str]  # per bundle
    cpus_per_bundle: float
    share: float  # fraction of each bundle device this role's actors request
    devices_per_bundle: int = 1  # 1: one bundle per device; > 1: one bundle per rollout engine (split placement)
    node_ids: list[str] | None = None  # per bundle: Ray's node id (nodes of one host share an ip); None: node_ips

    def __len__(self) -> int:
        return len(self.bundle_indices)

    def bundle_device_ids(self, i: int) -> list[int]:
        d = self.devices_per_bundle
        return list(self.device_ids[i * d:(i + 1) * d])

    def actor_options(self, i: int, extra_env: dict[str, str] | None = None,
                      device_ids: list[int] | None = None) -> dict[str, Any]:
        """`.options(**...)` for the actor on this role's i-th bundle: pinned to the bundle, a share of
        each of its devices and its CPUs, and the accelerator's worker environment for `device_ids`
        (default: the bundle's devices)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        acc = get_accelerator()
        env = {k: str(v) for k, v in acc.worker_env(device_ids or self.bundle_device_ids(i)).items()}
        if self.share < 1:  # colocated: trainer and engine share the devices (engines inherit this env)
            env.update(acc.colocated_env())
        env.update(extra_env or {})
        amount = self.share * self.devices_per_bundle
        return {
            "num_cpus": self.cpus_per_bundle * self.share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.bundle_indices[i],
                placement_group_capture_child_tasks=True),
            "runtime_env": {"env_vars": env},
            **device_request(int(amount) if float(amount).is_integer() else amount),
        }

    def engine_parts(self, engine: int, devices: int, per_device: bool = False) -> list[EnginePart]:
        """Where rollout engine `engine` of `devices` devices runs: one part per node it spans (SGLang: one server
        per node, --nnodes / --node-rank), or with `per_device` one part per device (the embedded engine: one
        process per device). Part 0 is the engine's first device, which serves HTTP.

        A colocated engine takes `devices` consecutive trainer bundles (ranks ordered by node, order_by_place):
        all on one node, or whole nodes, the same number of devices on each (SGLang's --nnodes layout; upstream's
        GLM-5 scripts: 64-device engines on 8-device nodes). Split placement: one bundle per engine, one node."""
        if self.devices_per_bundle == devices:
            if per_device and devices > 1:
                raise ValueError(f"the embedded engine splits over {devices} processes only on the trainer's own "
                                 "devices (--colocate, one bundle per device); use --colocate or SGLang")
            first, count = engine, 1
        elif self.devices_per_bundle == 1:
            first, count = engine * devices, devices
        else:
            raise ValueError(f"rollout bundles hold {self.devices_per_bundle} devices, engines need {devices}; "
                             "this is a placement bug")
        if first + count > len(self):
            raise ValueError(f"rollout engine {engine} needs bundles {first}..{first + count - 1} but only {len(self)} "
                             "were placed; check --rollout-num-gpus / --rollout-num-gpus-per-engine")
        node_of = self.node_ids or self.node_ips
        bundles = list(range(first, first + count))
        on_node: dict[str, list[int]] = {}
        for b in bundles:
            on_node.setdefault(node_of[b], []).append(b)
        if len(on_node) > 1:
            whole = all(len(bs) == node_of.count(n) for n, bs in on_node.items())
            if not whole or len({len(bs) for bs in on_node.values()}) > 1:
                raise ValueError(
                    f"rollout engine {engine} would span nodes {sorted(set(self.node_ips[b] for b in bundles))} with "
                    f"part of a node's devices; an engine's {devices} devices must be on one node or fill whole nodes: "
                    "make --rollout-num-gpus-per-engine divide the devices per node (or a multiple of them)")
        groups = [[b] for b in bundles] if per_device else list(on_node.values())
        parts = []
        for bs in groups:
            ids = [d for b in bs for d in self.bundle_device_ids(b)]
            parts.append(EnginePart(self.actor_options(bs[0], device_ids=ids), ids, self.node_ips[bs[0]]))
        return parts

    def engine_options(self, engine: int, devices: int) -> tuple[dict[str, Any], list[int]]:
        """(`.options(**...)`, device ids) of rollout engine `engine` spanning `devices` devices.

        Split placement (one bundle per engine, `devices_per_bundle == devices`): the actor reserves every
        device of its bundle. Colocated (one bundle per device, shared with the trainer): a Ray actor takes
        resources from one bundle only, so it books its share on its first device's bundle; the trainer
        ranks hold all the devices. An engine over several nodes: engine_parts."""
        parts = self.engine_parts(engine, devices)
        if len(parts) > 1:
            raise ValueError(f"rollout engine {engine} spans {len(parts)} nodes; place its parts with engine_parts")
        return parts[0].options, parts[0].device_ids


def bundle_devices(args) -> tuple[list[int], int]:
    """(devices of each bundle in creation order, number of trainer bundles). Trainer: one bundle per
    device. Colocated engines share those; split: one bundle per engine holding all its devices, so an
    engine's devices are on one node and reserved by its actor; an engine larger than a node (upstream's
    run-qwen3-235B-A22B: 32-device engines on 8-device nodes, not colocated) gets a bundle per device, and
    engine_parts places it over whole nodes as a colocated one."""
    # --debug-rollout-only: no trainer rank starts, so none is given a device
    world = 0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.colocate:
        return [1] * world, world
    per_engine = int(args.rollout_num_gpus_per_engine)
    if per_engine > args.num_gpus_per_node:  # no bundle can hold it (--num-gpus-per-node): one per device
        return [1] * world + [1] * args.rollout_num_gpus, world
    return [1] * world + [per_engine] * (args.rollout_num_gpus // per_engine), world


def _bundle(cpus: float, devices: int = 1) -> dict[str, float]:
    resource = get_accelerator().ray_resource
    return {"CPU": cpus} if resource is None else {resource: devices, "CPU": cpus}


def _probe_bundles(pg, devices: list[int]) -> list[tuple[str, list[int]]]:
    """(node ip, device ids) of each bundle, found by a tiny task scheduled on it (asking for all the
    devices of a multi-device bundle, so Ray names them all)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = get_accelerator().ray_resource
    if resource is None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) == 1:  # no devices and one node: every bundle is there, and the probe's answer is known
            # (each probe task starts a Ray worker process: ~0.6 core-s each on a 2-core machine, in every run)
            return [(nodes[0]["NodeManagerAddress"], [0] * count, nodes[0]["NodeID"]) for count in devices]

    @ray.remote(num_cpus=0)
    def where(count: int) -> tuple[str, list[int], str]:
        ctx = ray.get_runtime_context()
        ids = ctx.get_accelerator_ids().get(resource, []) if resource else []
        return ray.util.get_node_ip_address(), sorted(int(i) for i in ids) if ids else [0] * count, ctx.get_node_id()

    refs = []
    for i, count in enumerate(devices):
        opts: dict[str, Any] = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i), **device_request(count if count > 1 else 0.01)}
        refs.append(where.options(**opts).remote(count))
    return ray.get(refs)


def order_by_place(where: list[tuple[str, list[int]]], idx) -> list[int]:
    """Bundle indices `idx` sorted by (node, first device): trainer rank i takes the i-th. Megatron numbers its
    groups with TP fastest, then CP, EP, DP and PP slowest (initialize_model_parallel's "tp-cp-ep-dp-pp"), so
    consecutive ranks fill a node first: a TP group of at most a node's devices stays on one node, and a
    colocated engine of g devices (trainer ranks e*g .. e*g+g-1) shares its node with whole TP groups."""
    return sorted(idx, key=lambda i: (where[i][0], where[i][2] if len(where[i]) > 2 else "", where[i][1][:1], i))


def create_placement_groups(args, cpus_per_bundle: float | None = None, timeout_s: float = 120.0) -> dict[str, DeviceSlots]:
    """{"actor": ..., "rollout": ...} for the trainer world and the rollout engines (see module doc)."""
    import ray
    from ray.util.placement_group import placement_group

    devices, world = bundle_devices(args)
    total = len(devices)
    if cpus_per_bundle is None:
        available = ray.cluster_resources().get("CPU", 1.0)
        cpus_per_bundle = max(0.5, min(1.0, available / total)) if get_accelerator().ray_resource is None else 1.0
    bundles = [_bundle(cpus_per_bundle, d) for d in devices]
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        have = ray.cluster_resources()
        raise RuntimeError(
            f"placement group of {total} bundles ({bundles[0]} per trainer device"
            f"{'' if total == world else f', {bundles[-1]} per engine'}) not placed within {timeout_s:.0f}s "
            f"(cluster has {have}); lower --actor-num-gpus-per-node/--rollout-num-gpus or add resources")
    where = _probe_bundles(pg, devices)

    def by_place(idx: range) -> list[int]:
        return order_by_place(where, idx)

    def slots(idx: list[int], share: float, per_bundle: int = 1) -> DeviceSlots:
        return DeviceSlots(pg=pg, bundle_indices=idx, device_ids=[d for i in idx for d in where[i][1]],
                           node_ips=[where[i][0] for i in idx], cpus_per_bundle=cpus_per_bundle, share=share,
                           devices_per_bundle=per_bundle, node_ids=[where[i][2] for i in idx])

    trainer = by_place(range(world))
    if args.colocate:
        return {"actor": slots(trainer, TRAIN_SHARE_COLOCATED),
                "rollout": slots(trainer[:args.rollout_num_gpus], ROLLOUT_SHARE_COLOCATED)}
    return {"actor": slots(trainer, 1.0),
            "rollout": slots(by_place(range(world, total)), 1.0, devices[-1] if total > world else 1)}


def joins_ray_cluster() -> bool:
    """RAY_ADDRESS names a running cluster to join; `RAY_ADDRESS=local` asks for a new local one, which this
    process starts with the run's --num-cpus and device resources (and stops at the end, as with no RAY_ADDRESS)."""
    return os.environ.get("RAY_ADDRESS", "") not in ("", "local")


def init_ray(num_cpus: int | None = None) -> None:
    """Start (or join) Ray for a run: no dashboard, no token auth prompts, quiet usage stats."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if joins_ray_cluster():
        ray.init(include_dashboard=False, log_to_driver=True)  # the cluster's own resources
        return
    acc = get_accelerator()
    resources = None
    if acc.ray_resource is not None and acc.ray_resource not in _RAY_BUILTIN_OPTION:
        # A local cluster declares this node's devices under the accelerator's resource name (Ray
        # detects GPUs itself; other devices, e.g. NPUs, are declared explicitly).
        resources = {acc.ray_resource: float(acc.device_count())}
    # address="local": a new cluster even when Ray's temp dir records one (`ray start` or another run's
    # cluster_utils head on this machine). A bare ray.init() joins that one and then refuses num_cpus ("When
    # connecting to an existing cluster, num_cpus and num_gpus must not be provided"); joining is what
    # RAY_ADDRESS asks for (above).
    # No idle workers prestarted for the driver: every slime process is an actor or task with its own resources,
    # started when it is created, so the prestarted ones only cost their start-up (~0.7 core-s per run on 2 cores).
    ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=True,
             _system_config={"prestart_worker_first_driver": False})
