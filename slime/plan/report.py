"""Plain-text tables for plans (no third-party formatting library)."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from slime.plan.devices import ASSUMPTION_NOTE, GB, device_table
from slime.plan.estimate import Plan
from slime.plan.memory import tokens_per_device, train_memory


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def gb(x: float) -> str:
    return f"{x / GB:.1f}"


def devices_text() -> str:
    header, rows = device_table()
    return table(header, rows) + "\n" + ASSUMPTION_NOTE


def plan_text(p: Plan) -> str:
    w, e, t, rs = p.worst_stage, p.engine, p.time, p.rollout
    head = (f"model   {p.model.describe()}\n"
            f"device  {p.device.name}: {p.device.memory_gb:g} GB, usable {gb(p.usable)} GB "
            f"(after runtime reserve and fragmentation margin)\n"
            f"layout  {p.layout.short()}, sp={p.layout.sp}, edp={p.layout.expert_dp}, "
            f"{p.micro_batches} micro-batches/step of {tokens_per_device(p.layout, p.train)} tokens per device, "
            f"recompute={p.train.recompute}, distributed optimizer={p.train.distributed_optimizer}, "
            f"optimizer offload={p.train.optimizer_cpu_offload}")
    rows = [
        ["trainer params (worst stage %d)" % w.stage, f"{w.params / 1e9:.2f}B el", ""],
        ["  weights", gb(w.weights), f"{p.train.param_bytes} B/param"],
        ["  gradients", gb(w.grads), f"{p.train.grad_bytes} B/param"],
        ["  optimizer state (device)", gb(w.optimizer), f"host {gb(w.optimizer_host)} GB"],
        ["  activations", gb(w.activations), f"{w.micro_batches_in_flight} micro-batch(es) in flight"
         + (f"; counts the reference's memory of {', '.join(p.train.fallback_ops)} (no {p.device.key} kernel)"
            if p.train.fallback_ops else "")],
        ["  train phase total", gb(w.total), ""],
        ["engine weights / device", gb(e.weights), f"{rs.devices_per_engine} devices per engine"],
        ["engine KV pool / device", gb(max(e.kv_pool, 0)), f"mem_fraction_static {rs.mem_fraction_static}"],
        ["KV cache per token", f"{e.kv_bytes_per_token / 1024:.1f} KiB", "MLA latent + DSA index key, all layers"],
        ["KV tokens per engine", f"{e.kv_tokens:,.0f}", f"{e.concurrency:.2f}x of all samples at full length"],
        ["weight-sync bucket", gb(p.sync_bucket), "buffer + largest gathered tensor"],
    ]
    rows += [[f"phase peak: {k}", gb(v), ""] for k, v in p.phases.items()]
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    rows.append(["peak vs usable", f"{gb(p.peak)} / {gb(p.usable)}", verdict])
    times = (f"step-time lower bound {t.total_s:.1f} s = rollout {t.rollout_s:.1f} + logprob {t.logprob_s:.1f} "
             f"+ train {t.train_s:.1f} ({t.bound}-bound) + sync {t.sync_s:.2f}; pipeline bubble {t.bubble:.0%}, "
             f"CP collectives {t.cp_comm_s:.1f} s")
    out = [head, table(["per device", "GB", "note"], rows), times]
    out += [f"problem: {x}" for x in p.problems]
    return "\n".join(out)


def variants_text(p: Plan) -> str:
    """The worst stage's optimizer state with/without the distributed optimizer and CPU offload, and
    its activations with/without recompute."""
    rows = []
    for dist in (True, False):
        for off in (False, True):
            ts = replace(p.train, distributed_optimizer=dist, optimizer_cpu_offload=off)
            st = train_memory(p.model, p.layout, ts, p.micro_batches)[p.worst_stage.stage]
            rows.append([f"optimizer dist={dist} offload={off}", gb(st.optimizer), gb(st.optimizer_host), gb(st.total)])
    for rc in ("none", "full"):
        ts = replace(p.train, recompute=rc)
        st = train_memory(p.model, p.layout, ts, p.micro_batches)[p.worst_stage.stage]
        rows.append([f"activations recompute={rc}", gb(st.activations), "", gb(st.total)])
    return table(["variant", "device GB", "host GB", "train total GB"], rows)


def short_text(p: Plan) -> str:
    w = p.worst_stage
    return (f"plan: {p.model.name} on {p.layout.world} x {p.device.name}, {p.layout.short()}: "
            f"weights {gb(w.weights)} + grads {gb(w.grads)} + optimizer {gb(w.optimizer)} + activations "
            f"{gb(w.activations)} = {gb(w.total)} GB train; engine {gb(p.engine.weights)} GB weights + "
            f"{gb(max(p.engine.kv_pool, 0))} GB KV; peak {gb(p.peak)} of {gb(p.usable)} GB usable -> "
            f"{'fits' if p.fits else 'DOES NOT FIT'}; step >= {p.time.total_s:.0f} s")


def search_text(plans: Sequence[Plan]) -> str:
    rows = [[p.layout.short(), p.train.recompute, str(p.rollout.devices_per_engine), gb(p.worst_stage.total),
             gb(p.peak), gb(p.usable), "yes" if p.fits else "no", f"{p.time.total_s:.1f}"] for p in plans]
    return table(["layout", "recompute", "engine", "train GB", "peak GB", "usable GB", "fits", "step>= s"], rows)

