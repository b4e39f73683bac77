"""Search a few parallel layouts for a model on a device count and keep the ones that fit."""

from __future__ import annotations

from dataclasses import replace

from slime.plan.devices import DeviceProfile
from slime.plan.estimate import Plan, plan
from slime.plan.layout import Layout, RolloutSettings, TrainSettings
from slime.plan.model import ModelShape


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int, limit: int) -> list[int]:
    """Expert-parallel sizes: the divisors of the expert count up to the device count (powers of two for 256
    experts; 288 = 2^5 x 9 also gives 96, 144, 288)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, nodes: int, devices_per_node: int, pps: tuple[int, ...] = (1, 2, 4, 8),
                      cps: tuple[int, ...] = (1,), etp_modes: tuple[str, ...] = ("1",)) -> list[Layout]:
    """TP within a node, the given PP/CP sizes, EP a divisor of the expert count, expert-TP 1 or = TP;
    only layouts valid for `model`."""
    world = nodes * devices_per_node
    out = []
    for tp in _powers_of_two(devices_per_node):
        for pp in pps:
            for ep in _divisors(model.n_routed_experts, world):
                for cp in cps:
                    for etp in sorted({1 if m == "1" else tp for m in etp_modes}):
                        lay = Layout(nodes, devices_per_node, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp)
                        if not lay.problems(model):
                            out.append(lay)
    return out


def search(model: ModelShape, device: DeviceProfile, nodes: int, devices_per_node: int,
           ts: TrainSettings | None = None, rs: RolloutSettings | None = None, top: int = 10,
           recompute_options: tuple[str, ...] = ("none", "full"), include_unfit: bool = False,
           pps: tuple[int, ...] = (1, 2, 4, 8), cps: tuple[int, ...] = (1,),
           etp_modes: tuple[str, ...] = ("1",), engine_sizes: tuple[int, ...] = ()) -> list[Plan]:
    """Plans sorted by step-time lower bound, then train-phase memory (more headroom first); only fitting
    ones unless `include_unfit`. `engine_sizes` also tries these devices-per-engine values."""
    ts, rs = ts or TrainSettings(), rs or RolloutSettings()
    plans = []
    for lay in candidate_layouts(model, nodes, devices_per_node, pps, cps, etp_modes):
        for rc in recompute_options:
            for g in sorted(set(engine_sizes) | {rs.devices_per_engine}):
                try:
                    p = plan(model, lay, device, replace(ts, recompute=rc), replace(rs, devices_per_engine=g))
                except ValueError:
                    continue
                if p.fits or include_unfit:
                    plans.append(p)
    plans.sort(key=lambda p: (not p.fits, round(p.time.total_s, 3), p.phases["train"]))
    return plans[:top]


def fewest_nodes(model: ModelShape, device: DeviceProfile, devices_per_node: int | None = None,
                 ts: TrainSettings | None = None, rs: RolloutSettings | None = None, max_nodes: int = 64,
                 recompute_options: tuple[str, ...] = ("none", "full"), pps: tuple[int, ...] = (1,),
                 cps: tuple[int, ...] = (1,), etp_modes: tuple[str, ...] = ("1",),
                 engine_sizes: tuple[int, ...] = ()) -> Plan | None:
    """The fastest fitting plan on the smallest node count (1 .. max_nodes) that fits at all, or None."""
    dpn = devices_per_node or device.devices_per_node
    for nodes in range(1, max_nodes + 1):
        plans = search(model, device, nodes, dpn, ts, rs, top=1, recompute_options=recompute_options,
                       pps=pps, cps=cps, etp_modes=etp_modes, engine_sizes=engine_sizes)
        if plans:
            return plans[0]
    return None
