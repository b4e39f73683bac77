"""`python -m slime.plan`: per-device memory and step-time lower bound of an RL run layout.

    python -m slime.plan --model glm5.3-flash --device 950dt --nodes 16 --tp 4 --pp 4 --ep 32
    python -m slime.plan --model glm5.3-flash --device h200 --nodes 16 --search
    python -m slime.plan --list-devices
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from slime.plan.devices import DEVICES, get_device
from slime.plan.estimate import plan
from slime.plan.layout import Layout, RolloutSettings, TrainSettings
from slime.plan.model import ModelShape, registry_names
from slime.plan.report import devices_text, plan_text, search_text, short_text, variants_text
from slime.plan.search import fewest_nodes, search


def _size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB', '2GB'."""
    t = text.strip()
    for suffix, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m slime.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="glm5.3-flash",
                    help="HF config.json, checkpoint dir, or registry name (--list-models)")
    ap.add_argument("--device", default="950dt", help=f"device profile: {', '.join(DEVICES)}")
    g = ap.add_argument_group("layout (train.py flag names)")
    g.add_argument("--nodes", "--actor-num-nodes", dest="nodes", type=int, default=1)
    g.add_argument("--dp", type=int, help="data-parallel size: sets the node count to dp*tp*pp*cp / devices-per-node")
    g.add_argument("--devices-per-node", "--actor-num-gpus-per-node", dest="devices_per_node", type=int,
                   help="default: the device profile's")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    g.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1)
    g.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1)
    g.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int, default=1,
                   help="expert tensor parallel; default 1, as train.py runs (the GLM model keeps experts whole)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on when tp > 1")
    g = ap.add_argument_group("training")
    g.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    g.add_argument("--recompute", choices=("none", "full"), default=None,
                   help="default: full for one layout; --search tries both unless this is given")
    g.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--grad-bytes", type=int, default=4, help="4 = fp32 main grads, 2 = bf16 grads")
    g.add_argument("--no-mtp", dest="with_mtp", action="store_false", help="do not train the MTP layers")
    g.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: whole rollout)")
    g = ap.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=int, default=64)
    g.add_argument("--n-samples-per-prompt", type=int, default=8)
    g.add_argument("--max-prompt-len", type=int, default=2048)
    g.add_argument("--rollout-max-response-len", type=int, default=8192)
    g.add_argument("--avg-response-len", type=int, help="default: half the max")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=8)
    g.add_argument("--rollout-num-gpus", type=int, help="default: the trainer's devices (colocated)")
    g.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                   help="--offload-train/--offload-rollout: phases release each other's memory")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=0.8)
    g.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per cached element (1 = fp8 cache)")
    g.add_argument("--update-weight-buffer-size", type=_size, default=1 << 30)
    g = ap.add_argument_group("output")
    g.add_argument("--search", action="store_true", help="search tp/pp/ep/etp and recompute; list fitting layouts")
    g.add_argument("--top", type=int, default=10)
    g.add_argument("--search-pp", type=_ints, default=(1, 2, 4, 8), help="pipeline sizes to try, e.g. 1,2,4")
    g.add_argument("--search-cp", type=_ints, default=(1,), help="context-parallel sizes to try")
    g.add_argument("--search-engine", type=_ints, default=(), help="devices-per-engine values to try as well")
    g.add_argument("--search-etp", choices=("1", "tp", "both"), default="1",
                   help="expert-TP to try: 1 (what train.py runs), equal to TP (Megatron's default), or both")
    g.add_argument("--fewest", metavar="DEVICES", default=None,
                   help="comma-separated device keys: the fewest nodes that fit on each (search as --search, "
                        "node counts 1..--max-nodes), e.g. h200,h100,950dt,950pr,a3")
    g.add_argument("--max-nodes", type=int, default=64, help="largest node count --fewest tries")
    g.add_argument("--format", choices=("table", "short", "json"), default="table")
    g.add_argument("--list-devices", action="store_true")
    g.add_argument("--list-models", action="store_true")
    return ap


def settings(a: argparse.Namespace) -> tuple[TrainSettings, RolloutSettings]:
    ts = TrainSettings(max_tokens_per_gpu=a.max_tokens_per_gpu, recompute=a.recompute or "full",
                       distributed_optimizer=a.distributed_optimizer, optimizer_cpu_offload=a.optimizer_cpu_offload,
                       grad_bytes=a.grad_bytes, with_mtp=a.with_mtp)
    rs = RolloutSettings(rollout_batch_size=a.rollout_batch_size, n_samples_per_prompt=a.n_samples_per_prompt,
                         max_prompt_len=a.max_prompt_len, max_response_len=a.rollout_max_response_len,
                         avg_response_len=a.avg_response_len, devices_per_engine=a.rollout_num_gpus_per_engine,
                         rollout_devices=a.rollout_num_gpus, colocate=a.colocate, offload=a.offload,
                         mem_fraction_static=a.sglang_mem_fraction_static, kv_bytes=a.kv_bytes,
                         update_weight_buffer_bytes=a.update_weight_buffer_size,
                         global_batch_size=a.global_batch_size)
    return ts, rs


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.list_devices:
        print(devices_text())
        return 0
    if a.list_models:
        print("\n".join(registry_names()))
        return 0
    try:
        model = ModelShape.from_config(a.model)
        device = get_device(a.device)
        ts, rs = settings(a)
        dpn = a.devices_per_node or device.devices_per_node
        if a.dp:
            world = a.dp * a.tp * a.pp * a.cp
            if world % dpn:
                raise ValueError(f"--dp {a.dp}: dp*tp*pp*cp = {world} devices is not a whole number of "
                                 f"{dpn}-device nodes; change --dp or --devices-per-node")
            a.nodes = world // dpn
        if a.fewest:
            return _fewest(a, model, ts, rs)
        if a.search:
            etp_modes = ("1", "tp") if a.search_etp == "both" else (a.search_etp,)
            recompute = (a.recompute,) if a.recompute else ("none", "full")
            plans = search(model, device, a.nodes, dpn, ts, rs, top=a.top, recompute_options=recompute,
                           pps=a.search_pp, cps=a.search_cp,
                           etp_modes=etp_modes, engine_sizes=a.search_engine)
            if a.format == "json":
                print(json.dumps([{"layout": p.layout.short(), "recompute": p.train.recompute, "peak": p.peak,
                                   "usable": p.usable, "step_s": p.time.total_s} for p in plans], indent=1))
                return 0 if plans else 1
            print(f"{model.describe()}\n{a.nodes} x {dpn} {device.name}: {len(plans)} fitting layout(s) shown")
            print(search_text(plans) if plans else "no layout fits: add nodes, offload the optimizer or cut tokens")
            return 0 if plans else 1
        layout = Layout(a.nodes, dpn, tp=a.tp, pp=a.pp, ep=a.ep, cp=a.cp, etp=a.etp,
                        sequence_parallel=a.sequence_parallel)
        p = plan(model, layout, device, ts, rs)
    except ValueError as e:
        print(f"slime.plan: {e}", file=sys.stderr)
        return 2
    if a.format == "short":
        print(short_text(p))
    elif a.format == "json":
        w = p.worst_stage
        print(json.dumps({"model": model.name, "device": device.key, "layout": asdict(layout), "fits": p.fits,
                          "usable": p.usable, "peak": p.peak, "phases": p.phases, "worst_stage": asdict(w),
                          "engine": asdict(p.engine), "sync_bucket": p.sync_bucket,
                          "step_time": asdict(p.time) | {"total_s": p.time.total_s},
                          "problems": list(p.problems)}, indent=1))
    else:
        print(plan_text(p))
        print()
        print(variants_text(p))
    return 0 if p.fits else 1


def _fewest(a: argparse.Namespace, model: ModelShape, ts: TrainSettings, rs: RolloutSettings) -> int:
    recompute = (a.recompute,) if a.recompute else ("none", "full")
    etp_modes = ("1", "tp") if a.search_etp == "both" else (a.search_etp,)
    print(f"{model.describe()}\nfewest nodes that fit (distributed optimizer {ts.distributed_optimizer}, "
          f"CPU offload {ts.optimizer_cpu_offload}, recompute {'/'.join(recompute)}, pp in {a.search_pp}, "
          f"cp in {a.search_cp})")
    print("| device | nodes x devices | layout | recompute | engine devices | train GB | peak GB / usable |")
    print("|---|---|---|---|---|---|---|")
    found = True
    for key in a.fewest.split(","):
        device = get_device(key.strip())
        p = fewest_nodes(model, device, a.devices_per_node, ts, rs, a.max_nodes, recompute, a.search_pp,
                         a.search_cp, etp_modes, a.search_engine)
        if p is None:
            found = False
            print(f"| {device.key} | > {a.max_nodes} nodes | - | - | - | - | - |")
            continue
        lay = p.layout
        print(f"| {device.key} | {lay.nodes} x {lay.devices_per_node} = {lay.world} | {lay.short()} | "
              f"{p.train.recompute} | {p.rollout.devices_per_engine} | {p.phases['train'] / 1e9:.0f} | {p.peak / 1e9:.0f} / {p.usable / 1e9:.0f} |")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
