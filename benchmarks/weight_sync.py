"""Weight-sync bandwidth: trainer -> a real embedded engine server process, vs the device's copy bandwidth.

    python benchmarks/weight_sync.py [--max-mb 1024] [--sizes 8,64,256,1024] [--modes ipc,ipc-handles,distributed]

Weights: a synthetic GLM-5-shaped set (benchmarks/synthetic_glm.py: bfloat16 + float32, per-expert HF names,
~2 MB median tensor); a set of size S is the first S MiB of the names in export order (a layer's
experts all or none, see prefix_of). The engine
(slime.backends.embedded, its own process) serves a model with exactly these names and dtypes; the
weight-set mode (ipc) gets an engine process of its own, as it changes the engine's storage layout.

Each sync goes through the trainer's own sender, `slime.backends.megatron.weight_sync.WeightSync`, fed by
an export in buckets of --update-weight-buffer-size bytes that yields, like the GLM export (--export glm),
the stored tensors themselves, expert weights as transposed views of megatron's layout (--export copy: a
fresh contiguous copy of every tensor, as the GLM export did before; --export view: all stored contiguous).
Modes:
  ipc          WeightSync's colocated path to the embedded engine: its weights live in two shared weight
               sets (slime.backends.embedded.weight_sets); the export's tensors are copied once, straight
               into the set the engine does not read, in the engine's layout (expert weights stored as the
               trainer stores them, "in_out"; "hf" with --export view/copy), then committed (one copy per byte)
  ipc-buckets  the embedded engine through the shared-bucket path (the fallback for engines without weight
               sets): the export's tensors copied into reused, double-buffered shared uint8 buffers
               (shared_buckets.py), posted as SGLang's load_format "flattened_bucket", copied out by the
               engine (two copies per byte); not run unless asked for in --modes
  ipc-handles  the shared-bucket sender as an SGLang engine gets it (HF layout, the same format), buffers
               reused on a synchronized device (CPU)
  distributed  /init_weights_update_group once, then per bucket /update_weights_from_distributed + broadcast
               over get_accelerator().process_group_backend()
Reference: `dst.copy_(src)` of the same number of bytes on the same device (best of 5), measured in this run.
After every timed sync every synced tensor is checksummed on both sides (not timed), unless --check 1,
which times the trainer's own verification (--check-weight-sync 1) as part of the sync. Then, for the
largest set, the time of each mode is split by component (export and packing, handles, HTTP calls,
waits, broadcast, checksums).

--checkpoint DIR replaces the synthetic set by a real HF checkpoint (e.g. the quick start's tiny GLM-5,
outputs/glm5-tiny/model) served by the engine's own CLI (`python -m slime.backends.embedded`), in one set.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

MODES = ("ipc", "ipc-handles", "distributed", "ipc-buckets")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=1024, help="largest weight set (MiB); sizes above it are dropped")
    ap.add_argument("--sizes", default="8,64,256,1024", help="comma-separated weight-set sizes in MiB")
    ap.add_argument("--modes", default="ipc,ipc-handles,distributed", help=f"comma-separated subset of {MODES}")
    ap.add_argument("--update-weight-buffer-size", type=int, default=64 * 1024**2,
                    help="bytes per exported bucket (the quick start's value)")
    ap.add_argument("--export", choices=("glm", "copy", "view"), default="glm",
                    help="glm: the stored tensors, expert weights as views of megatron's stacked layout (the GLM export at tp=ep=1); "
                         "copy: a fresh contiguous copy of every tensor; view: the stored tensors, all contiguous")
    ap.add_argument("--repeats", type=int, default=2, help="timed syncs per size and mode (best is reported)")
    ap.add_argument("--check", type=int, choices=(0, 1), default=0,
                    help="1: include the trainer's checksum verification (--check-weight-sync 1) in the timed sync")
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint dir to sync instead of the synthetic set")
    a = ap.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown --modes {bad}; choose from {','.join(MODES)}")
    try:
        a.sizes = sorted({float(s) for s in a.sizes.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--sizes must be comma-separated numbers of MiB, got {a.sizes!r}")
    a.sizes = [s for s in a.sizes if 0 < s <= a.max_mb]
    if a.checkpoint:
        if not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
            ap.error(f"--checkpoint {a.checkpoint}: no config.json there; pass an HF checkpoint directory")
        a.sizes = [math.inf]
    if not a.sizes:
        ap.error("no --sizes left at or below --max-mb")
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    return a


# ---------------------------------------------------------------- the engine process
class EngineProcess:
    """The engine in its own process: the synthetic model (synthetic_glm.py) or, with `checkpoint`, the
    engine's CLI on that checkpoint. Token through the environment, as the launcher passes it."""

    def __init__(self, spec: dict[str, Any] | None, checkpoint: str | None = None) -> None:
        import json

        from slime.backends.embedded.__main__ import TOKEN_ENV

        self.token = secrets.token_hex(16)
        env = dict(os.environ, **{TOKEN_ENV: self.token})
        if checkpoint:
            cmd = [sys.executable, "-m", "slime.backends.embedded", "--model-path", checkpoint, "--port", "0"]
        else:
            cmd = [sys.executable, os.path.join(HERE, "synthetic_glm.py"), "--spec", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
        self.url = ""
        for line in self.proc.stdout:
            if line.startswith("URL ") or line.startswith("embedded engine serving"):
                self.url = line.split()[-1]
                break
        if not self.url:
            self.proc.kill()
            raise RuntimeError(f"engine process did not start (exit code {self.proc.poll()}); see its stderr above")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def checkpoint_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in file order, in float32 where floating (the engine's dtype on CPU)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out = []
    for f in files:
        for name, t in load_file(os.path.join(path, f)).items():
            out.append((name, t.float() if t.is_floating_point() else t))
    return out


# ---------------------------------------------------------------- sender side
def make_weights(specs: list[tuple[str, tuple[int, ...], torch.dtype]], device: torch.device
                 ) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.empty(s, dtype=d, device=device).uniform_(-1, 1, generator=gen)) for n, s, d in specs]


def prefix_of(weights: list[tuple[str, torch.Tensor]], mib: float) -> list[tuple[str, torch.Tensor]]:
    """Tensors in export order up to `mib` MiB (tensors that would overshoot are skipped). A layer's expert
    weights are taken all or none, at the place of the first: the engine holds them as one fused tensor
    per layer, and a real sync updates every expert (a sync of some experts of a fused tensor costs the
    weight-set engine a copy of the others)."""
    units: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in weights:
        units.setdefault(name.split(".experts.")[0] + ".experts" if is_expert_weight(name) else name, []).append((name, t))
    out, total, limit = [], 0, mib * 2**20
    for unit in units.values():
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        if total + nbytes <= limit:
            out += unit
            total += nbytes
    return out


def exporter(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, copy: bool,
             components: "Components | None" = None) -> Callable[[], Iterator[list[tuple[str, torch.Tensor]]]]:
    """Buckets of about `bucket_bytes`, closed once they reach it (as hf_export.export_hf does)."""
    from slime.backends.megatron.hf_export import bucketed

    def copied():
        for name, t in named:
            if copy:
                t0 = time.perf_counter()
                t = t.clone()
                if components is not None:
                    components.add("export (copy out of the model)", time.perf_counter() - t0)
            yield name, t

    return lambda: bucketed(copied(), bucket_bytes)


def is_expert_weight(name: str) -> bool:
    return ".experts." in name and name.endswith("_proj.weight")


def glm_layout(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Expert weights stored as megatron stores them (per layer weight1 [E, H, 2I] = [gate | up] columns,
    weight2 [E, I, H]) and handed out as WeightMap.to_hf does at tp = ep = 1, in its order: per expert
    `w1[e][:, :I].t()`, `w1[e][:, I:].t()` (gate, up), then every `w2[e].t()` (down), non-contiguous views,
    where the layer's first expert weight was; the rest as stored."""
    by_name = dict(weights)
    out = dict(weights)
    layers = sorted({n.split(".experts.")[0] for n in by_name if is_expert_weight(n)})
    export_order: dict[str, list[str]] = {}
    for layer in layers:
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in by_name
                          if n.startswith(layer + ".experts.") and is_expert_weight(n)})
        p = [f"{layer}.experts.{e}." for e in experts]
        if not all(f"{q}{k}_proj.weight" in by_name for q in p for k in ("gate", "up", "down")):
            continue
        w1 = torch.stack([torch.cat([by_name[q + "gate_proj.weight"].t(), by_name[q + "up_proj.weight"].t()], 1)
                          for q in p])
        w2 = torch.stack([by_name[q + "down_proj.weight"].t() for q in p])
        ffn = w1.shape[2] // 2
        for i, q in enumerate(p):
            out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = w1[i][:, :ffn].t(), w1[i][:, ffn:].t()
            out[q + "down_proj.weight"] = w2[i].t()
        export_order[layer] = [q + k for q in p for k in ("gate_proj.weight", "up_proj.weight")] + \
            [q + "down_proj.weight" for q in p]
    names: list[str] = []
    for n, _ in weights:
        layer = n.split(".experts.")[0] if is_expert_weight(n) else None
        if layer not in export_order:
            names.append(n)
        elif export_order[layer]:
            names += export_order[layer]
            export_order[layer] = []
    return [(n, out[n]) for n in names]


def all_checksums(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    from slime.utils import weight_checksum

    return weight_checksum.named_checksums(named)


# ---------------------------------------------------------------- component timers
OVERLAPS = " (in a thread, overlaps the others)"
NESTED = " (inside another component)"
SPANS = " (a span that holds other components)"  # shown, but not subtracted for "other": its parts are


class Components:
    """Wall time per component of a sync, by wrapping the functions WeightSync calls (no change to them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []
        self._depth = threading.local()  # wrapped calls in progress on this thread

    def add(self, key: str, dt: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def wrap(self, owner: Any, attr: str, key: Callable[..., str] | str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth
                name = key(*args, **kwargs) if callable(key) else key
                self.add(name + (NESTED if depth and not name.endswith(OVERLAPS) else ""), time.perf_counter() - t0)

        own = attr in getattr(owner, "__dict__", {})  # else a method found on the class: delete ours after
        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def install(self, ws) -> None:
        from slime.accelerator import ipc
        from slime.backends.megatron.weight_sync import shared_buckets, weight_sets
        from slime.utils import distributed, weight_checksum

        def where(key: str) -> Callable[..., str]:
            return lambda *a, **k: key + ("" if threading.current_thread() is threading.main_thread() else OVERLAPS)

        self.wrap(shared_buckets.SharedBucketSender, "add", "copy into the shared buffers")
        self.wrap(weight_sets.WeightSetWriter, "add", "copy into the weight sets")
        self.wrap(weight_sets.WeightSetWriter, "flush", "copy into the weight sets")
        self.wrap(ws, "post", lambda engine, path, *a, **k: where("HTTP " + path)())
        self.wrap(ipc, "serialize_named_tensors", where("handles (pickle)"))
        self.wrap(distributed, "broadcast", "broadcast (sender side)")
        self.wrap(shared_buckets, "pack_into", "packing into the send buffer (distributed)")
        self.wrap(ws.broadcast, "finish", "wait for the bucket on the wire (broadcast, engine's receive and copy)")
        self.wrap(weight_checksum, "named_checksums", where("checksums (trainer side)"))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


# ---------------------------------------------------------------- measurements
def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system, all threads) this process and the processes `pids` have used so far."""
    total = time.process_time()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):  # no procfs: CPU figures stay the sender's alone
            pass
    return total


def copy_seconds(nbytes: int, device: torch.device, sync: Callable[[], None], min_total_s: float = 0.5,
                 cpu: dict[str, float] | None = None) -> float:
    """Best time of `dst.copy_(src)` over at least 5 copies and `min_total_s` seconds; `cpu["copy"]` gets
    the fewest CPU seconds one copy took."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # touched: measure copying, not first-touch page faults
    best, spent, n, best_cpu = math.inf, 0.0, 0, math.inf
    while n < 5 or spent < min_total_s:
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        best, spent, n, best_cpu = min(best, dt), spent + dt, n + 1, min(best_cpu, time.process_time() - c0)
    if cpu is not None:
        cpu["copy"] = best_cpu
    return best


def time_sync(ws, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, copy: bool, repeats: int,
              version: list[int], components: Components | None = None, cpu: dict[str, float] | None = None,
              pids: tuple[int, ...] = ()) -> float:
    """Best wall time of `repeats` syncs of `named`; `components` (if given) collects the last sync's split;
    `cpu["sync"]` gets the fewest CPU seconds (this process and the engine's, `pids`) a sync took."""
    best, best_cpu = math.inf, math.inf
    for i in range(repeats):
        last = components is not None and i == repeats - 1
        ws.export = exporter(named, bucket_bytes, copy, components if last else None)
        if last:
            components.install(ws)
        version[0] += 1
        t0, c0 = time.perf_counter(), cpu_seconds(list(pids))
        try:
            ws.sync(version[0])
        finally:
            if last:
                components.uninstall()
        dt = time.perf_counter() - t0
        best, best_cpu = min(best, dt), min(best_cpu, cpu_seconds(list(pids)) - c0)
        if last:
            components.add("total", dt)
        if last:
            # after the export, waiting for the engines' last answers (the posts themselves overlap it)
            components.add("after the export: last flush, waits, commit (WeightSync's split)" + SPANS,
                           ws.last_split["time/weight_sync_wait"])
        if not ws.check:
            ws.verify(all_checksums(named))
    if cpu is not None:
        cpu["sync"] = best_cpu
    return best


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from slime.accelerator import get_accelerator
    from slime.backends.megatron.weight_sync import EngineEndpoint, WeightSync
    from synthetic_glm import build_model, model_spec, named_specs

    acc = get_accelerator()
    device = acc.device()
    t_start = time.perf_counter()
    spec = None if a.checkpoint else model_spec(max(a.sizes))
    engine = EngineProcess(spec, a.checkpoint)
    # The weight-set sync moves the engine's expert weights into the trainer's layout; the other modes get an
    # engine of their own that keeps its loaded (HF) layout, as each would in a run.
    sets_engine = EngineProcess(spec, a.checkpoint) if "ipc" in a.modes and len(a.modes) > 1 else engine
    try:
        if a.checkpoint:
            weights = [(n, t.to(device)) for n, t in checkpoint_weights(a.checkpoint)]
        else:
            weights = make_weights(named_specs(build_model(spec)), device)
        if a.export == "glm":
            weights = glm_layout(weights)
        served = {m: sets_engine if m == "ipc" else engine for m in a.modes}
        layout = "in_out" if a.export == "glm" else "hf"  # the export's expert layout, for the weight sets
        syncs = {m: WeightSync("distributed" if m == "distributed" else "ipc", lambda: iter(()),
                               [EngineEndpoint(url=served[m].url, token=served[m].token)], rank=0,
                               check=bool(a.check), buffer_bytes=a.update_weight_buffer_size, expert_layout=layout)
                 for m in a.modes}
        for m in ("ipc-handles", "ipc-buckets"):
            if m in syncs:  # the shared-bucket path
                syncs[m].takes_weight_sets = lambda engine: False
        if "ipc-handles" in syncs:  # as an engine without the read-before-reply promise (SGLang) is served
            syncs["ipc-handles"].tensor_handles.takes_flat_buffers = lambda engine: False
        if "distributed" in syncs:
            t0 = time.perf_counter()
            syncs["distributed"].connect()
            print(f"distributed group ({acc.process_group_backend()}) formed in {time.perf_counter() - t0:.2f}s")
        model = a.checkpoint or f"synthetic GLM-5 shapes, {spec['num_hidden_layers']} layers"
        print(f"device={acc.name} engine={engine.url} model: {model}, {len(weights)} tensors, "
              f"{sum(t.numel() * t.element_size() for _, t in weights) / 2**20:.0f} MiB; bucket "
              f"{a.update_weight_buffer_size / 2**20:.0f} MiB; export={a.export}; check={a.check}; best of {a.repeats}; "
              f"torch threads={torch.get_num_threads()}")
        rows, version = [], [0]
        split = {m: Components() for m in a.modes}
        for mib in a.sizes:
            largest = mib == a.sizes[-1]
            named = prefix_of(weights, mib)
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            cpu: dict[str, float] = {}
            row = {"MiB": nbytes / 2**20, "tensors": len(named),
                   "copy": nbytes / copy_seconds(nbytes, device, acc.synchronize, cpu=cpu)}
            row["copy cpu"] = cpu["copy"]
            for m, ws in syncs.items():
                row[m] = nbytes / time_sync(ws, named, a.update_weight_buffer_size, a.export == "copy", a.repeats,
                                            version, split[m] if largest else None, cpu, (served[m].proc.pid,))
                row[m + " cpu"] = cpu["sync"]
            rows.append(row)
            print(_row_text(row, a.modes), flush=True)
        for ws in syncs.values():
            ws.close()
    finally:
        engine.close()
        if sets_engine is not engine:
            sets_engine.close()
    print()
    print(_table(rows, a.modes))
    print()
    print("CPU seconds of the copy and of one sync (sender + engine process, all threads), and their ratio: "
          "what the bandwidth ratio would be with the CPU to itself (under load the wall-clock ratios compare "
          "a best-of short copy with a long sync that gets only its share of the cores)")
    print(_cpu_table(rows, a.modes))
    print()
    print(f"where the time of one sync of the largest set goes ({rows[-1]['MiB']:.1f} MiB), seconds (share):")
    print(_split_table(split, a.modes))
    load = os.getloadavg()[0]
    print(f"goal: colocated (ipc) sync >= 0.5x copy bandwidth at >= 256 MiB; load average {load:.1f}; "
          f"total {time.perf_counter() - t_start:.0f}s")


def _row_text(row: dict[str, float], modes: list[str]) -> str:
    parts = [f"{row['MiB']:8.1f} MiB {row['tensors']:5d} tensors  copy {row['copy'] / 1e9:6.2f} GB/s"]
    parts += [f"{m} {row[m] / 1e9:6.3f} GB/s ({row[m] / row['copy']:.3f}x)" for m in modes]
    return "  ".join(parts)


def _table(rows: list[dict[str, float]], modes: list[str]) -> str:
    head = "| MiB | tensors | copy GB/s | " + " | ".join(f"{m} GB/s (x copy)" for m in modes) + " |"
    lines = [head, "|" + "---|" * (3 + len(modes))]
    for r in rows:
        cells = [f"{r['MiB']:.1f}", str(r["tensors"]), f"{r['copy'] / 1e9:.2f}"]
        cells += [f"{r[m] / 1e9:.3f} ({r[m] / r['copy']:.3f}x)" for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpu_table(rows: list[dict[str, float]], modes: list[str]) -> str:
    lines = ["| MiB | copy CPU s | " + " | ".join(f"{m} CPU s (copy / sync)" for m in modes) + " |",
             "|" + "---|" * (2 + len(modes))]
    for r in rows:
        cells = [f"{r['MiB']:.1f}", f"{r['copy cpu']:.3f}"]
        cells += [f"{r[m + ' cpu']:.3f} ({r['copy cpu'] / r[m + ' cpu']:.3f}x)" if r[m + " cpu"] > 0 else "-"
                  for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _split_table(split: dict[str, Components], modes: list[str]) -> str:
    keys = sorted({k for m in modes for k in split[m].seconds if k != "total"},
                  key=lambda k: -max(split[m].seconds.get(k, 0.0) for m in modes))
    lines = ["| component | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for k in keys + ["other (bucketing, Python, waits)", "total"]:
        cells = []
        for m in modes:
            sec = split[m].seconds
            total = sec.get("total", 0.0)
            v = (total - sum(v for kk, v in sec.items()
                             if kk != "total" and not kk.endswith((OVERLAPS, NESTED, SPANS)))
                 if k.startswith("other") else sec.get(k, 0.0))
            cells.append(f"{v:.3f} ({100 * v / total:.0f}%)" if total else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
