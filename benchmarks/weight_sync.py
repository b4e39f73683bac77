"""Weight-sync bandwidth: trainer -> a real embedded engine server process, vs the device's copy bandwidth.

    python benchmarks/weight_sync.py [--max-mb 1024] [--sizes 8,64,256,1024] [--modes ipc,ipc-flat,ipc-reuse,distributed]

Weights: a synthetic GLM-5-shaped set (benchmarks/synthetic_glm.py: bfloat16 + float32, per-expert HF names,
~2 MB median tensor); a set of size S is the first S MiB of the checkpoint-ordered names. The engine
(slime.backends.embedded, its own process) serves a model with exactly these names and dtypes.

Each sync goes through the trainer's own sender, `slime.backends.megatron.weight_sync.WeightSync`, fed by
an export that, like the GLM export, yields a fresh copy of every tensor in buckets of
--update-weight-buffer-size bytes (--export view yields the stored tensors themselves, as the export does
for weights it passes through unchanged). Modes:
  ipc          WeightSync's colocated path: per-tensor shared-memory handles -> /update_weights_from_tensor
  ipc-flat     the same, but each bucket flattened per dtype (load_format "flattened_bucket")
  ipc-reuse    prototype of a faster sender (not the trainer's code yet): per-dtype flat buffers shared once and
               reused by every bucket; the export writes each tensor straight into its slot (one copy), posted
               as flattened_bucket
  distributed  /init_weights_update_group once, then per bucket /update_weights_from_distributed + broadcast
               over get_accelerator().process_group_backend()
Reference: `dst.copy_(src)` of the same number of bytes on the same device (best of 3), measured in this run.
After every timed sync a sample of the synced tensors is checksummed on both sides (not timed), unless
--check 1, which times the trainer's own verification (every synced tensor, both sides) as part of the sync.
Then, for the largest set, the time of each mode is split by component (export, handles, HTTP calls,
broadcast, checksums).

--checkpoint DIR replaces the synthetic set by a real HF checkpoint (e.g. the quick start's tiny GLM-5,
outputs/glm5-tiny/model) served by the engine's own CLI (`python -m slime.backends.embedded`), in one set.
"""

from __future__ import annotations

import argparse
import base64
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

MODES = ("ipc", "ipc-flat", "ipc-reuse", "distributed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=1024, help="largest weight set (MiB); sizes above it are dropped")
    ap.add_argument("--sizes", default="8,64,256,1024", help="comma-separated weight-set sizes in MiB")
    ap.add_argument("--modes", default="ipc,ipc-reuse,distributed", help=f"comma-separated subset of {MODES}")
    ap.add_argument("--update-weight-buffer-size", type=int, default=64 * 1024**2,
                    help="bytes per exported bucket (the quick start's value)")
    ap.add_argument("--export", choices=("copy", "view"), default="copy",
                    help="copy: every sync exports fresh tensors (GLM export of transposed/gathered weights); "
                         "view: the stored tensors themselves")
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
    """Checkpoint-ordered tensors up to `mib` MiB (tensors that would overshoot are skipped)."""
    out, total, limit = [], 0, mib * 2**20
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if total + nbytes <= limit:
            out.append((name, t))
            total += nbytes
    return out


def exporter(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, copy: bool,
             components: "Components | None" = None) -> Callable[[], Iterator[list[tuple[str, torch.Tensor]]]]:
    """Buckets of about `bucket_bytes`, closed once they reach it (as hf_export.export_hf does)."""
    def export():
        bucket, size = [], 0
        for name, t in named:
            if copy:
                t0 = time.perf_counter()
                t = t.clone()
                if components is not None:
                    components.add("export (copy out of the model)", time.perf_counter() - t0)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket
    return export


def flattened_sender(ws) -> Callable[[list[tuple[str, torch.Tensor]], int], None]:
    """A `_send_ipc` replacement posting each bucket as per-dtype flat tensors (load_format flattened_bucket)."""
    from slime.accelerator import get_accelerator, ipc
    from slime.backends.embedded import flattened_bucket
    from slime.backends.megatron.weight_sync import _check_reply

    def send(bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        flats, meta = flattened_bucket.flatten_named_tensors(bucket)
        payload = base64.b64encode(ipc.serialize_named_tensors(get_accelerator(), flats)).decode()
        for engine in ws.engines:
            _check_reply(ws.post(engine, "/update_weights_from_tensor", {
                "serialized_named_tensors": [payload], "load_format": "flattened_bucket",
                "flattened_bucket_meta": meta, "flush_cache": False, "weight_version": str(version)}),
                "update_weights_from_tensor")
    return send


class ReusedBuffers:
    """The ipc-reuse sender: one flat buffer per dtype, in shared memory from the start and reused, so a sync
    pays one copy per byte on each side and no per-bucket shared-memory segments."""

    def __init__(self, ws, capacity_bytes: int) -> None:
        self.ws, self.capacity = ws, capacity_bytes
        self.flats: dict[torch.dtype, tuple[str, torch.Tensor]] = {}

    def _flat(self, dtype: torch.dtype, device: torch.device) -> tuple[str, torch.Tensor]:
        if dtype not in self.flats:
            from slime.accelerator import get_accelerator

            flat = torch.zeros(self.capacity // dtype.itemsize, dtype=dtype, device=device)
            get_accelerator().reduce_tensor(flat)  # shares it now (on CPU: moves it into shared memory once)
            self.flats[dtype] = (f"reuse_{str(dtype).removeprefix('torch.')}", flat)
        return self.flats[dtype]

    def fill(self, flat: torch.Tensor, items: list[tuple[str, torch.Tensor]]) -> list[int]:
        offsets, off = [], 0
        for _, t in items:
            if off + t.numel() > flat.numel():
                raise ValueError(f"bucket overflows the {self.capacity}-byte shared buffer; raise its capacity")
            flat[off:off + t.numel()].view(t.shape).copy_(t)
            offsets.append(off)
            off += t.numel()
        return offsets

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        from slime.accelerator import get_accelerator, ipc
        from slime.backends.megatron.weight_sync import _check_reply

        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, t in bucket:
            groups.setdefault(t.dtype, []).append((name, t))
        flats, meta = [], []
        for dtype, items in groups.items():
            key, flat = self._flat(dtype, items[0][1].device)
            offsets = self.fill(flat, items)
            flats.append((key, flat))
            meta.append({"bucket": key, "dtype": str(dtype).removeprefix("torch."), "names": [n for n, _ in items],
                         "shapes": [list(t.shape) for _, t in items], "offsets": offsets})
        payload = base64.b64encode(ipc.serialize_named_tensors(get_accelerator(), flats)).decode()
        for engine in self.ws.engines:
            _check_reply(self.ws.post(engine, "/update_weights_from_tensor", {
                "serialized_named_tensors": [payload], "load_format": "flattened_bucket",
                "flattened_bucket_meta": meta, "flush_cache": False, "weight_version": str(version)}),
                "update_weights_from_tensor")


def sample_checksums(named: list[tuple[str, torch.Tensor]], k: int = 12, max_bytes: int = 16 * 2**20
                     ) -> dict[str, list[float]]:
    """Checksums of about `k` tensors spread over the set (each <= max_bytes: checksums are slow)."""
    from slime.utils import weight_checksum

    small = [(n, t) for n, t in named if t.numel() * t.element_size() <= max_bytes] or named[:1]
    picked = small[:: max(1, len(small) // k)] + [small[-1]]
    return weight_checksum.named_checksums(picked)


# ---------------------------------------------------------------- component timers
OVERLAPS = " (in a thread, overlaps the others)"


class Components:
    """Wall time per component of a sync, by wrapping the functions WeightSync calls (no change to them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def add(self, key: str, dt: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def wrap(self, owner: Any, attr: str, key: Callable[..., str] | str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(key(*args, **kwargs) if callable(key) else key, time.perf_counter() - t0)

        own = attr in getattr(owner, "__dict__", {})  # else a method found on the class: delete ours after
        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def install(self, ws) -> None:
        from slime.accelerator import ipc
        from slime.backends.embedded import flattened_bucket
        from slime.utils import distributed, weight_checksum

        if getattr(ws, "reuse", None) is not None:
            self.wrap(ws.reuse, "fill", "export (copy into the shared buffer)")
        self.wrap(ws, "post", lambda engine, path, *a, **k: "HTTP " + path + (
            "" if threading.current_thread() is threading.main_thread() else OVERLAPS))
        self.wrap(ipc, "serialize_named_tensors", "handles (share memory + pickle)")
        self.wrap(flattened_bucket, "flatten_named_tensors", "flatten (torch.cat per dtype)")
        self.wrap(distributed, "broadcast", "broadcast (sender side)")
        self.wrap(weight_checksum, "named_checksums", "checksums (trainer side)")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


# ---------------------------------------------------------------- measurements
def copy_seconds(nbytes: int, device: torch.device, sync: Callable[[], None], min_total_s: float = 0.5) -> float:
    """Best time of `dst.copy_(src)` over at least 5 copies and `min_total_s` seconds."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # touched: measure copying, not first-touch page faults
    best, spent, n = math.inf, 0.0, 0
    while n < 5 or spent < min_total_s:
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def time_sync(ws, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, copy: bool, repeats: int,
              version: list[int], components: Components | None = None) -> float:
    """Best wall time of `repeats` syncs of `named`; `components` (if given) collects the last sync's split."""
    best = math.inf
    for i in range(repeats):
        last = components is not None and i == repeats - 1
        ws.export = exporter(named, bucket_bytes, copy, components if last else None)
        if last:
            components.install(ws)
        version[0] += 1
        t0 = time.perf_counter()
        try:
            ws.sync(version[0])
        finally:
            if last:
                components.uninstall()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        if last:
            components.add("total", dt)
        if not ws.check:
            ws.verify(sample_checksums(named))
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
    try:
        if a.checkpoint:
            weights = [(n, t.to(device)) for n, t in checkpoint_weights(a.checkpoint)]
        else:
            weights = make_weights(named_specs(build_model(spec)), device)
        endpoint = EngineEndpoint(url=engine.url, token=engine.token)
        syncs = {m: WeightSync("distributed" if m == "distributed" else "ipc", lambda: iter(()), [endpoint], rank=0,
                               check=bool(a.check)) for m in a.modes}
        if "ipc-flat" in syncs:
            syncs["ipc-flat"]._send_ipc = flattened_sender(syncs["ipc-flat"])
        if "ipc-reuse" in syncs:
            biggest = max(t.numel() * t.element_size() for _, t in weights)
            reuse = syncs["ipc-reuse"].reuse = ReusedBuffers(syncs["ipc-reuse"], a.update_weight_buffer_size + biggest)
            for dtype in {t.dtype for _, t in weights}:  # allocated and shared once, at connect time
                reuse._flat(dtype, device)
            syncs["ipc-reuse"]._send_ipc = reuse.send
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
            row = {"MiB": nbytes / 2**20, "tensors": len(named),
                   "copy": nbytes / copy_seconds(nbytes, device, acc.synchronize)}
            for m, ws in syncs.items():
                copy = a.export == "copy" and m != "ipc-reuse"  # ipc-reuse's copy is the write into its buffer
                row[m] = nbytes / time_sync(ws, named, a.update_weight_buffer_size, copy, a.repeats,
                                            version, split[m] if largest else None)
            rows.append(row)
            print(_row_text(row, a.modes), flush=True)
        for ws in syncs.values():
            ws.close()
    finally:
        engine.close()
    print()
    print(_table(rows, a.modes))
    print()
    print(f"where the time of one sync of the largest set goes ({rows[-1]['MiB']:.1f} MiB), seconds (share):")
    print(_split_table(split, a.modes))
    print(f"goal: colocated (ipc) sync >= 0.5x copy bandwidth at >= 256 MiB; total {time.perf_counter() - t_start:.0f}s")


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


def _split_table(split: dict[str, Components], modes: list[str]) -> str:
    keys = sorted({k for m in modes for k in split[m].seconds if k != "total"},
                  key=lambda k: -max(split[m].seconds.get(k, 0.0) for m in modes))
    lines = ["| component | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for k in keys + ["other (bucketing, Python, waits)", "total"]:
        cells = []
        for m in modes:
            sec = split[m].seconds
            total = sec.get("total", 0.0)
            v = (total - sum(v for kk, v in sec.items() if kk != "total" and not kk.endswith(OVERLAPS))
                 if k.startswith("other") else sec.get(k, 0.0))
            cells.append(f"{v:.3f} ({100 * v / total:.0f}%)" if total else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
