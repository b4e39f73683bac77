"""One-call validation of an accelerator machine; writes one markdown report.

    python benchmarks/device_check.py --out DIR            # every section on the detected device
    python benchmarks/device_check.py --out DIR --dry-run  # resolve everything, run nothing heavy
    python benchmarks/device_check.py --out DIR --allow-cpu --size tiny   # the same code on the CPU

Sections (--sections picks a subset):
  tests        `pytest -m device tests`: the accelerator-parametrized tests on the real device
  ops          every op of the op table, forward and backward, bfloat16 and float32, against a float64
               reference computed on the host from the same inputs (error = max |dev - ref| / max(1, max |ref|)),
               and the device op's time against the reference op's time on the device
  ipc          share_tensor on this process, open_tensor in a spawned child, writes seen both ways
  collective   a 1-rank group on process_group_backend(): all_reduce, broadcast, all_gather
  model        the tiny GLM-5 and a GLM-5-shaped model of --big-gb GB of bfloat16 weights: log-probs against
               transformers' on the same weights, one training step (tokens/s, MFU, peak memory_stats())
  weight_sync  benchmarks/weight_sync.py's colocated (ipc) mode against the device's copy bandwidth
The report is DIR/device-report.md; the exit status is 1 when a check is outside its tolerance or failed.
--dry-run prints the plan (op table, model sizes and their memory, commands) and checks imports only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

SECTIONS = ("tests", "ops", "ipc", "collective", "model", "weight_sync")
# Stated tolerances of the op check (max |error| / max(1, max |reference|)), as in tests/test_ops.py.
OP_TOL = {"float32": 2e-5, "bfloat16": 3e-2}
ATTN_OPS = ("attention", "sparse_attention", "kda")  # sums over whole sequences
ATTN_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
# Log-probs against transformers on the same weights: float32 (tiny) and bfloat16 (big model) tolerances.
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.25}
# Peak dense bf16 tensor-core FLOP/s used for MFU, by device-name substring (vendor data sheets, dense).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


@dataclass
class Section:
    name: str
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def row(self, *cells) -> None:
        self.lines.append("| " + " | ".join(str(c) for c in cells) + " |")

    def fail(self, what: str) -> None:
        self.failures.append(what)


def _header(section: Section, *names: str) -> None:
    section.row(*names)
    section.row(*["---"] * len(names))


# ---------------------------------------------------------------- tests
def run_tests(acc, s: Section, a) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "device", "tests", "-p", "no:cacheprovider"]
    env = dict(os.environ, SLIME_TEST_REAL_DEVICES="1", SLIME_TEST_NPU="1")
    s.lines.append(f"`{' '.join(cmd[1:])}`")
    if a.dry_run:
        return
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.tests_timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
    s.lines.append(f"\nresult (exit {proc.returncode}): `{tail[0]}`")
    if proc.returncode == 5 and acc.name == "cpu":
        s.lines.append("\nno device-marked test applies on the CPU")
    elif proc.returncode != 0:
        s.fail(f"device tests exit {proc.returncode}")
        s.lines.append("\n```\n" + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:]) + "\n```")


# ---------------------------------------------------------------- ops
def _to_host64(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double() if x.is_floating_point() else x.detach().cpu()
    return x


def _rel_err(actual, expected) -> float:
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    return (actual - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def _op_errors(name: str, dev_fn, ref_fn, args, kwargs, grad_args) -> tuple[float, float | None]:
    """(forward error, backward error or None) of the device op against the float64 host reference."""
    import torch
    from ops import _by_expert, _float_outputs

    def run(fn, xs):
        xs = [x.detach().requires_grad_(True) if i in grad_args else x for i, x in enumerate(xs)]
        out = fn(*xs, **kwargs)
        floats = [o for o in _float_outputs(out) if o.requires_grad]
        grads = []
        if floats:
            seeds = [torch.ones_like(o) for o in floats]
            torch.autograd.backward(floats, seeds)
            grads = [xs[i].grad for i in grad_args]
        return out, grads

    dev_out, dev_grads = run(dev_fn, list(args))
    ref_out, ref_grads = run(ref_fn, [_to_host64(x) for x in args])
    if name == "moe_route":
        dev_out, ref_out = _by_expert(dev_out), _by_expert(ref_out)
    d, r = _float_outputs(dev_out), _float_outputs(ref_out)
    if not d:  # index outputs (lightning indexer): share of rows whose selected sets differ
        a_, b_ = (dev_out[0] if isinstance(dev_out, tuple) else dev_out), (ref_out[0] if isinstance(ref_out, tuple) else ref_out)
        a_, b_ = a_.cpu(), b_.cpu()
        return (a_.sort(-1).values != b_.sort(-1).values).any(-1).float().mean().item(), None
    fwd = max(_rel_err(x, y) for x, y in zip(d, r))
    bwd = max((_rel_err(x, y) for x, y in zip(dev_grads, ref_grads) if x is not None and y is not None), default=None)
    return fwd, bwd


def run_ops(acc, s: Section, a) -> None:
    import torch
    from ops import SIZES, _cases, _time

    from slime.accelerator.ops import OP_NAMES, reference_op

    from slime.accelerator import op_report

    size = SIZES["small" if a.size == "tiny" else "large"]
    # GLM-5.3-Flash's ops first: which of them a run of glm5_next here would serve on the reference.
    rows = op_report.op_rows(acc.ops, op_report.model_ops("glm5_next"))
    s.lines += [f"glm5_next ops on the reference here (--require-device-kernels would refuse): "
                f"{', '.join(op_report.fallbacks(rows)) or 'none'}", ""]
    _header(s, "op", "dtype", "implementation", "fwd err", "bwd err", "tol", "ref ms", "dev ms", "speed-up")
    cases = _cases()
    for name in [o for o in OP_NAMES if not a.ops or o in a.ops.split(",")]:
        for dtype_name in ("bfloat16", "float32"):
            label = acc.ops.source(name)
            if a.dry_run:
                s.row(name, dtype_name, label, "", "", "", "", "", "")
                continue
            tol = (ATTN_TOL if name in ATTN_OPS else OP_TOL)[dtype_name]
            try:
                torch.manual_seed(0)
                case = cases[name]
                args, kwargs = case.make(acc.device(), getattr(torch, dtype_name), size)
                fwd, bwd = _op_errors(name, getattr(acc.ops, name), reference_op(name), args, kwargs, case.grad_args)
                backward = bool(case.grad_args)
                t_ref = _time(acc, reference_op(name), args, kwargs, case.grad_args, backward, 0.1, 10)
                t_dev = _time(acc, getattr(acc.ops, name), args, kwargs, case.grad_args, backward, 0.1, 10)
            except Exception as e:  # a failing op is a finding, not the end of the report
                s.row(name, dtype_name, label, f"error: {type(e).__name__}: {str(e)[:80]}", "", "", "", "", "")
                s.fail(f"{name} {dtype_name}: {type(e).__name__}")
                continue
            index_op = name in ("lightning_indexer", "kpool_indexer")
            ok = fwd <= (0.02 if index_op and dtype_name == "bfloat16" else 0.0 if index_op else tol) and (bwd is None or bwd <= tol)
            if not ok:
                s.fail(f"{name} {dtype_name}: error {fwd:.2e}/{bwd} > {tol}")
            fwd_txt = f"{fwd:.1%} rows differ" if index_op else f"{fwd:.2e}"
            s.row(name, dtype_name, label, fwd_txt, "-" if bwd is None else f"{bwd:.2e}", tol if not index_op else "rows",
                  f"{t_ref:.3f}", f"{t_dev:.3f}", f"{t_ref / t_dev:.2f}x" + ("" if ok else " **FAIL**"))


# ---------------------------------------------------------------- ipc
def _ipc_child(handle: bytes, accelerator: str, queue) -> None:
    try:
        os.environ["SLIME_ACCELERATOR"] = accelerator
        from slime.accelerator import get_accelerator

        acc = get_accelerator()
        if acc.device_count() > 1:  # open from another current device: the handle names its own device
            acc.set_device((int(os.environ.get("SLIME_IPC_SOURCE_INDEX", "0")) + 1) % acc.device_count())
        t = acc.open_tensor(handle)
        queue.put(("sum", float(t.double().sum().item()), str(t.device)))
        t.mul_(2)  # visible to the parent only when the memory is really shared
        acc.synchronize()
        queue.put(("done", None, None))
    except BaseException as e:  # report, never hang the parent
        queue.put(("error", f"{type(e).__name__}: {e}", None))


def run_ipc(acc, s: Section, a) -> None:
    import torch

    s.lines.append(f"share_tensor -> spawned child open_tensor ({acc.name}, {a.ipc_mb} MiB float32; the child's "
                   "current device is another index when the machine has several)")
    if a.dry_run:
        return
    t = torch.arange(a.ipc_mb * 262144, dtype=torch.float32, device=acc.device())
    want = float(t.double().sum().item())
    handle = acc.share_tensor(t)
    os.environ["SLIME_IPC_SOURCE_INDEX"] = str(t.device.index or 0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(handle, acc.name, queue))
    start = time.perf_counter()
    child.start()
    try:
        kind, value, where = queue.get(timeout=120)
        if kind != "sum":
            raise RuntimeError(value)
        kind2, value2, _ = queue.get(timeout=60)
        if kind2 != "done":
            raise RuntimeError(value2)
    except Exception as e:
        s.fail(f"ipc: {e}")
        s.lines.append(f"\nFAIL: {e}")
        return
    finally:
        child.join(timeout=30)
    acc.synchronize()
    seen_back = float(t.double().sum().item())
    ok_open, ok_write = value == want, seen_back == 2 * want
    s.lines.append(f"\nchild saw the parent's values: {ok_open} (on {where}); parent saw the child's write: {ok_write}; "
                   f"{time.perf_counter() - start:.1f}s including the child's start")
    if not (ok_open and ok_write):
        s.fail("ipc: values not shared")


# ---------------------------------------------------------------- collective
def run_collective(acc, s: Section, a) -> None:
    import torch
    import torch.distributed as dist

    from slime.utils.net import free_port

    backend = acc.process_group_backend()
    s.lines.append(f"1-rank group, backend `{backend}`")
    if a.dry_run:
        return
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.arange(1 << 20, dtype=torch.float32, device=acc.device())
        start = time.perf_counter()
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        out = [torch.empty_like(x)]
        dist.all_gather(out, x)
        acc.synchronize()
        ok = torch.equal(out[0], torch.arange(1 << 20, dtype=torch.float32, device=acc.device()))
        s.lines.append(f"\nall_reduce + broadcast + all_gather of 4 MiB: values intact {ok}, "
                       f"{(time.perf_counter() - start) * 1e3:.1f} ms (first call, includes set-up)")
        if not ok:
            s.fail("collective: values changed")
    finally:
        if owns:
            dist.destroy_process_group()


# ---------------------------------------------------------------- model
def big_config(target_gb: float) -> dict:
    """GLM-5's shape (scripts/models/configs/glm5-744B-A40B.json, glm_moe_dsa: the model this check builds) with 64
    experts and as many layers as fit `target_gb` GB of bfloat16 weights (at least 2: one dense, one MoE)."""
    from slime.plan.model import ModelShape, load_config

    _, cfg = load_config("glm5-744B-A40B")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")} | dict(n_routed_experts=64, num_nextn_predict_layers=0,
                                                                        first_k_dense_replace=1)
    layers = 2
    while ModelShape.from_config(cfg | dict(num_hidden_layers=layers + 1)).hf_param_count() * 2 <= target_gb * 1e9:
        layers += 1
    return cfg | dict(num_hidden_layers=layers, max_position_embeddings=8192)


def _train_flops(cfg: dict, tokens: int, seq: int) -> float:
    """6 x active params x tokens, plus causal attention score/value FLOPs (x3 for backward)."""
    from slime.plan.model import ModelShape

    shape = ModelShape.from_config(cfg)
    dense = 6.0 * shape.active_param_count(with_embeddings=False) * tokens
    heads = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    attn = 3 * 2 * heads * (qk + cfg["v_head_dim"]) * tokens * seq / 2 * cfg["num_hidden_layers"]
    return dense + attn


def _model_case(acc, s: Section, a, label: str, cfg_overrides: dict, dtype_name: str, seq: int, batch: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.glm5.tiny import tiny_config, write_tiny_checkpoint

    dtype = getattr(torch, dtype_name)
    dev = acc.device()
    acc.apply_patches("transformers")  # the DSA top-k tie rule of ops.lightning_indexer, as the engine runs it
    with tempfile.TemporaryDirectory(dir=a.scratch) as tmp:
        start = time.perf_counter()
        ckpt = f"{tmp}/ckpt"
        if label == "tiny":
            write_tiny_checkpoint(ckpt, "glm_moe_dsa", seed=0, dtype=dtype_name, initializer_range=0.2)
        else:  # initialise on the device: minutes less than a host init of this size
            config = tiny_config("glm_moe_dsa", **cfg_overrides)
            with torch.device(dev):
                hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
            hf.save_pretrained(ckpt, safe_serialization=True)
            del hf
        made = time.perf_counter() - start
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).eval()
        model = load_hf_model(ckpt, dtype=dtype)
        with open(f"{ckpt}/config.json") as f:
            hf_cfg = json.load(f)
    vocab = model.arch.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(dev)
    pos = torch.arange(seq, device=dev).expand(batch, seq).contiguous()
    with torch.no_grad():
        ours = torch.log_softmax(model(ids, pos).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        ref = torch.log_softmax(hf(ids, position_ids=pos).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    lp_err = (ours - ref).abs().max().item()
    del hf
    acc.empty_cache()
    # One training step: forward, backward, optimizer (Adam on float32; SGD on the big bfloat16 model, whose
    # Adam state would not fit one device: the full trainer shards it with the distributed optimizer).
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-5) if label == "tiny" else torch.optim.SGD(params, lr=1e-5)
    model.train()

    def step(model=model, opt=opt):
        opt.zero_grad(set_to_none=True)
        logits = model(ids, pos)
        loss = -torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        opt.step()

    step()  # warm-up: kernel selection, allocator
    acc.synchronize()
    acc.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        acc.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    peak = acc.memory_stats().get("peak_allocated", 0)
    tokens = batch * seq
    flops = _train_flops(hf_cfg, tokens, seq)
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in acc.describe()), None)
    mfu = f"{flops / t / peak_flops:.1%}" if peak_flops else "n/a (peak unknown)"
    n_params = sum(p.numel() for p in params)
    tol = LOGPROB_TOL[dtype_name]
    ok = lp_err <= tol
    if not ok:
        s.fail(f"model {label}: log-prob error {lp_err:.3g} > {tol}")
    s.row(label, f"{n_params / 1e9:.3f}B", dtype_name, f"{batch}x{seq}", f"{lp_err:.2e} (tol {tol})" + ("" if ok else " **FAIL**"),
          f"{tokens / t:,.0f}", mfu, f"{peak / 2**30:.2f}", f"{made:.0f}s")
    del model, opt
    acc.empty_cache()


def run_model(acc, s: Section, a) -> None:
    from slime.plan.model import ModelShape

    big = big_config(a.big_gb)
    shape = ModelShape.from_config(big)
    s.lines.append(f"big model: GLM-5 shape, 64 experts, {big['num_hidden_layers']} layers: "
                   f"{shape.hf_param_count() / 1e9:.2f}B parameters = {shape.hf_param_count() * 2 / 1e9:.1f} GB bfloat16 "
                   f"(device needs ~3x for weights + grads + transformers' copy at the log-prob check)\n")
    _header(s, "model", "params", "dtype", "batch x seq", "max abs log-prob diff vs transformers", "tokens/s",
            "MFU", "peak GiB", "checkpoint made in")
    if a.dry_run:
        import megatron.core
        import transformers

        s.lines.append(f"\nimports: megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
        return
    cases = [("tiny", {}, "float32", 64, 2)]
    if a.big_gb > 0:
        cases.append(("big", big, "bfloat16", a.big_seq, 1))
    for label, overrides, dtype_name, seq, batch in cases:
        try:
            _model_case(acc, s, a, label, overrides, dtype_name, seq, batch)
        except Exception as e:
            s.row(label, "", dtype_name, "", f"error: {type(e).__name__}: {str(e)[:120]}", "", "", "", "")
            s.fail(f"model {label}: {type(e).__name__}")
            traceback.print_exc()


# ---------------------------------------------------------------- weight sync
def run_weight_sync(acc, s: Section, a) -> None:
    cmd = [sys.executable, os.path.join(HERE, "weight_sync.py"), "--modes", "ipc", "--sizes", a.sync_sizes,
           "--max-mb", str(max(int(x) for x in a.sync_sizes.split(",")))]
    s.lines.append(f"`{' '.join(cmd[1:])}`")
    if a.dry_run:
        return
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.tests_timeout)
    out = (proc.stdout.strip().splitlines() or ["(no output)"])[-20:]
    s.lines.append("\n```\n" + "\n".join(out) + "\n```")
    if proc.returncode != 0:
        s.fail(f"weight_sync exit {proc.returncode}")
        s.lines.append("\n```\n" + "\n".join(proc.stderr.strip().splitlines()[-15:]) + "\n```")


RUNNERS: dict[str, Callable] = {"tests": run_tests, "ops": run_ops, "ipc": run_ipc, "collective": run_collective,
                                "model": run_model, "weight_sync": run_weight_sync}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for device-report.md")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing heavy")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (checks this script, not a device)")
    ap.add_argument("--size", choices=("tiny", "full"), default=None, help="default: full on a device, tiny on the CPU")
    ap.add_argument("--big-gb", type=float, default=None, help="GB of bf16 weights of the big model (0: skip; default 30, 0 tiny)")
    ap.add_argument("--big-seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per model (median reported)")
    ap.add_argument("--ops", default=None, help="comma-separated op names for the ops section (default: all)")
    ap.add_argument("--ipc-mb", type=int, default=64)
    ap.add_argument("--sync-sizes", default=None, help="weight-sync set sizes in MiB (default 256,1024; 8 tiny)")
    ap.add_argument("--tests-timeout", type=int, default=300)
    ap.add_argument("--scratch", default=None, help="directory for temporary checkpoints (default: system temp)")
    a = ap.parse_args(argv)
    sections = [x for x in a.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")

    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.name == "cpu" and not (a.allow_cpu or a.dry_run):
        print("device_check: no GPU or NPU here (accelerator: cpu); pass --dry-run or --allow-cpu", file=sys.stderr)
        return 2
    # A dry run plans the device sizes; a CPU run defaults to tiny ones.
    tiny = (a.size or ("tiny" if acc.name == "cpu" and not a.dry_run else "full")) == "tiny"
    a.size = "tiny" if tiny else "full"
    a.big_gb = a.big_gb if a.big_gb is not None else (0.0 if tiny else 30.0)
    a.sync_sizes = a.sync_sizes or ("8" if tiny else "256,1024")
    import torch

    os.makedirs(a.out, exist_ok=True)
    header = [f"# Device check: {acc.describe()}", "",
              f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              f"- command: `python benchmarks/device_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
              f"- python {sys.version.split()[0]}, torch {torch.__version__}, mode: "
              + ("dry run (plan only)" if a.dry_run else f"{a.size} sizes"), ""]
    body, failed = [], []
    for name in sections:
        s = Section(name)
        start = time.perf_counter()
        print(f"=== {name}", flush=True)
        try:
            RUNNERS[name](acc, s, a)
        except Exception as e:
            s.fail(f"{name}: {type(e).__name__}: {e}")
            s.lines.append(f"\nsection failed: `{type(e).__name__}: {str(e)[:300]}`")
            traceback.print_exc()
        body += [f"## {name} ({time.perf_counter() - start:.1f}s)", "", *s.lines, ""]
        if s.failures:
            body += ["failures: " + "; ".join(s.failures), ""]
        failed += s.failures
        print("\n".join(s.lines), flush=True)
    verdict = "dry run: nothing was measured" if a.dry_run else (
        f"{len(failed)} check(s) failed" if failed else "every check within its tolerance")
    report = "\n".join(header + [f"**{verdict}**", ""] + body)
    path = os.path.join(a.out, "device-report.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(report)
    os.replace(tmp, path)
    print(f"device_check: {verdict}; report {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
