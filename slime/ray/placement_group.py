"""Ray placement of trainer ranks and rollout engines on accelerator devices.

One bundle per device: `{<accelerator ray resource>: 1, "CPU": c}` (GPU, NPU), or `{"CPU": c}` when
the accelerator has no Ray resource (CPU: a bundle is a worker slot). Colocated: trainer and
engines share the same bundles, each taking a fraction of the device; split: engines get bundles
after the trainer's. Each bundle's device id is probed once so workers can be pinned with
`get_accelerator().worker_env([id])` (Ray's own visible-device setting is turned off there).
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
class DeviceSlots:
    """Bundles of one placement group given to one role (trainer or rollout)."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    bundle_indices: list[int]
    device_ids: list[int]  # accelerator id of each bundle on its node (0 for CPU slots)
    node_ips: list[str]
    cpus_per_bundle: float
    share: float  # fraction of each bundle this role's actors request

    def __len__(self) -> int:
        return len(self.bundle_indices)

    def actor_options(self, i: int, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        """`.options(**...)` for the actor on this role's i-th bundle: pinned to the bundle, a share of
        its device and CPUs, and the accelerator's worker environment for that device."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        acc = get_accelerator()
        env = {k: str(v) for k, v in acc.worker_env([self.device_ids[i]]).items()}
        env.update(extra_env or {})
        return {
            "num_cpus": self.cpus_per_bundle * self.share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.bundle_indices[i],
                placement_group_capture_child_tasks=True),
            "runtime_env": {"env_vars": env},
            **device_request(self.share),
        }


def _bundle(cpus: float) -> dict[str, float]:
    resource = get_accelerator().ray_resource
    return {"CPU": cpus} if resource is None else {resource: 1, "CPU": cpus}


def _probe_bundles(pg, count: int) -> list[tuple[str, int]]:
    """(node ip, device id) of each bundle, found by a tiny task scheduled on it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = get_accelerator().ray_resource

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, int]:
        ctx = ray.get_runtime_context()
        ids = ctx.get_accelerator_ids().get(resource, []) if resource else []
        return ray.util.get_node_ip_address(), int(ids[0]) if ids else 0

    refs = []
    for i in range(count):
        opts: dict[str, Any] = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i), **device_request(0.01)}
        refs.append(where.options(**opts).remote())
    return ray.get(refs)


def create_placement_groups(args, cpus_per_bundle: float | None = None, timeout_s: float = 120.0) -> dict[str, DeviceSlots]:
    """{"actor": ..., "rollout": ...} for the trainer world and the rollout engines (see module doc)."""
    import ray
    from ray.util.placement_group import placement_group

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    rollout = args.rollout_num_gpus
    total = world if args.colocate else world + rollout
    if cpus_per_bundle is None:
        available = ray.cluster_resources().get("CPU", 1.0)
        cpus_per_bundle = max(0.5, min(1.0, available / total)) if get_accelerator().ray_resource is None else 1.0
    pg = placement_group([_bundle(cpus_per_bundle) for _ in range(total)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        have = ray.cluster_resources()
        raise RuntimeError(
            f"placement group of {total} bundles {_bundle(cpus_per_bundle)} not placed within {timeout_s:.0f}s "
            f"(cluster has {have}); lower --actor-num-gpus-per-node/--rollout-num-gpus or add resources")
    where = _probe_bundles(pg, total)
    # Order bundles by (node, device) so rank i and engine i land on predictable devices.
    order = sorted(range(total), key=lambda i: (where[i][0], where[i][1], i))

    def slots(idx: list[int], share: float) -> DeviceSlots:
        return DeviceSlots(pg=pg, bundle_indices=idx, device_ids=[where[i][1] for i in idx],
                           node_ips=[where[i][0] for i in idx], cpus_per_bundle=cpus_per_bundle, share=share)

    if args.colocate:
        return {"actor": slots(order[:world], TRAIN_SHARE_COLOCATED),
                "rollout": slots(order[:rollout], ROLLOUT_SHARE_COLOCATED)}
    return {"actor": slots(order[:world], 1.0), "rollout": slots(order[world:], 1.0)}


def init_ray(num_cpus: int | None = None) -> None:
    """Start (or join) Ray for a run: no dashboard, no token auth prompts, quiet usage stats."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False, log_to_driver=True)
        return
    acc = get_accelerator()
    resources = None
    if acc.ray_resource is not None and acc.ray_resource not in _RAY_BUILTIN_OPTION:
        # A local cluster declares this node's devices under the accelerator's resource name (Ray
        # detects GPUs itself; other devices, e.g. NPUs, are declared explicitly).
        resources = {acc.ray_resource: float(acc.device_count())}
    ray.init(num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=True)
