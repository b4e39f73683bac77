"""Where an RL iteration's time goes: the main job's script for a few iterations.

    python benchmarks/rl_iteration.py [--model glm5_next|glm5] [--num-rollout 8] [--run-dir DIR] [-- train.py flags]

--model glm5_next (default): the tiny GLM-5.3-Flash main job, scripts/run-glm5.3-flash-tiny-cpu.sh (KDA + DSA
layers, mHC, MoE); --model glm5: the tiny GLM-5 job, scripts/run-glm5-tiny-cpu.sh. Runs the script itself (same
flags, same model and task; checkpoint, prompts and held-out prompts are written once into --run-dir, default
/tmp/slime-bench-rl/MODEL, and reused), then reads the metrics.jsonl that train.py writes and prints, per phase,
the mean seconds over the steady iterations (all but the first, which pays one-time costs) and the share of
the iteration. The held-out evaluations the scripts run (before training and every 5 rollouts) are outside the
iterations' time (train.py evaluates after closing an iteration's record); their time is printed apart.

  compute   engine generate      rollout/engine_generate_time: the busiest engine's time in generation waves
                                 (its own stats, /health), else rollout/generate_time
            trainer log-probs    time/log_probs: old-policy / reference forward (no grad); 0 when the trainer
                                 reuses its training forward's log-probs
            trainer fwd/bwd/opt  time/train_forward + _backward + _optimizer (else time/train)
  overhead  rollout requests     rollout/generate_time - engine generate: HTTP requests, engine batching
                                 waits, rewards, in the rollout manager
            rollout hand-off     time/rollout - rollout/generate_time: packing the samples into the object store,
                                 the engines' memory release (--offload-rollout), the reply (metrics and an
                                 object reference) back to the driver
            trainer other        time/train - fwd/bwd/opt: packing micro-batches, metric reductions
            weight sync          time/weight_sync (export and copy, engine copy, control calls, verification)
                                 (the engine check before it, with the engines' memory coming back under
                                 --offload-rollout, is in the driver's share: time/weight_sync_call)
            save                 time/save
            driver + Ray calls   time/iteration - all of the above (Ray round trips; the samples go from the
                                 rollout manager to the trainer ranks through the object store)

overhead = iteration - (engine generate + trainer log-probs + trainer fwd/bwd/opt). Goal: <= 10% of the
iteration.
--profile PREFIX records py-spy profiles (raw) of the driver, trainer actor, rollout manager and engine
processes into PREFIX.<role>.txt (benchmarks/profile_summary.py summarizes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from statistics import mean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"glm5_next": "run-glm5.3-flash-tiny-cpu.sh", "glm5": "run-glm5-tiny-cpu.sh"}  # --model -> scripts/
MODEL_TYPES = {"glm5_next": "glm5_next", "glm5": "glm_moe_dsa"}  # the checkpoint's config.json model_type
COMPUTE = (("engine generate", "generate"), ("trainer log-probs", "time/log_probs"),
           ("trainer fwd/bwd/opt", "train_compute"))
OVERHEAD = (("rollout requests", "requests"), ("rollout hand-off", "handoff"), ("trainer other", "train_other"),
            ("weight sync", "time/weight_sync"), ("save", "time/save"), ("driver + Ray calls", "driver"))
TRAIN_PARTS = ("time/train_forward", "time/train_backward", "time/train_optimizer")
DETAILS = (("engine forward (in generate)", "rollout/engine_forward_time"),
           ("weight sync: export + copy", "time/weight_sync_export"), ("weight sync: wait for engines",
                                                                      "time/weight_sync_wait"),
           ("weight sync: control calls", "time/weight_sync_control"),
           ("weight sync: verification", "time/weight_sync_verify"),
           ("rollout hand-off: the manager around generate_rollout (versions, packing, object store)",
            "manager_own"),
           ("rollout hand-off: engines' memory released (--offload-rollout, in the same call)",
            "time/rollout_offload"),
           ("rollout hand-off: Ray call of generate beyond the manager's time", "ray_rollout"),
           ("weight sync call: engines' memory back (--offload-rollout, in the engine check)", "time/rollout_onload"),
           ("driver: Ray call of train beyond log-probs + advantages + time/train", "ray_train"),
           ("driver: of which the trainer's own time outside those (time/train_rollout)", "trainer_rest"),
           ("driver: its own CPU time (time/driver_cpu; the samples never reach it)", "driver_cpu"),
           ("driver: Ray call of the weight sync beyond time/weight_sync", "ray_sync"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SCRIPTS), default="glm5_next",
                    help="glm5_next: the tiny GLM-5.3-Flash main job; glm5: the tiny GLM-5 job")
    ap.add_argument("--num-rollout", type=int, default=8, help="iterations to run (the first is reported apart)")
    ap.add_argument("--run-dir", default=None,
                    help="tiny checkpoint and data (written once, reused; default /tmp/slime-bench-rl/MODEL); each "
                         "run goes to RUN_DIR/bench-<time>")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="record py-spy profiles (raw) into PREFIX.<role>.txt")
    ap.add_argument("--profile-rate", type=int, default=25, help="py-spy samples per second")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "/tmp/pyspy-venv/bin/py-spy",
                    help="py-spy executable for --profile")
    ap.add_argument("--driver-scaling", default=None, metavar="SIZES",
                    help="e.g. 64,512: run once per samples-per-rollout size (8 samples per prompt, short "
                         "responses) and compare the driver's CPU time per iteration")
    ap.add_argument("extra", nargs="*", help="after --: extra train.py flags")
    a = ap.parse_args(argv)
    if a.num_rollout < 2:
        ap.error("--num-rollout must be >= 2 (the first iteration is a warm-up)")
    a.script = os.path.join(ROOT, "scripts", SCRIPTS[a.model])
    if not os.path.isfile(a.script):
        ap.exit(2, f"--model {a.model}: {a.script} does not exist; pick another --model or restore the script\n")
    a.run_dir = a.run_dir or os.path.join("/tmp/slime-bench-rl", a.model)
    cached = _cached_model_type(a.run_dir)
    if cached not in (None, MODEL_TYPES[a.model]):
        ap.exit(2, f"--run-dir {a.run_dir} holds a {cached} checkpoint, not {MODEL_TYPES[a.model]} (--model "
                   f"{a.model}); pass another --run-dir or remove {a.run_dir}/model\n")
    if a.profile and not os.access(a.py_spy, os.X_OK):
        ap.error(f"--profile needs py-spy; {a.py_spy} is not executable (install it, e.g. into a separate venv, "
                 "and pass --py-spy PATH)")
    return a


def _cached_model_type(run_dir: str) -> str | None:
    """model_type of the tiny checkpoint cached in run_dir, None when there is none yet."""
    try:
        with open(os.path.join(run_dir, "model", "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def phases(record: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of one metrics.jsonl record (keys of COMPUTE/OVERHEAD, plus iteration)."""
    def get(key: str) -> float:
        v = record.get(key, 0.0)
        return float(v) if isinstance(v, (int, float)) else 0.0

    rollout_gen = get("rollout/generate_time") or get("time/rollout")
    train = get("time/train")
    out = {"iteration": get("time/iteration"), "generate": min(get("rollout/engine_generate_time") or rollout_gen,
                                                               rollout_gen),
           "time/log_probs": get("time/log_probs"),
           "train_compute": sum(get(k) for k in TRAIN_PARTS) if all(k in record for k in TRAIN_PARTS) else train,
           "time/weight_sync": get("time/weight_sync"), "time/save": get("time/save")}
    out["requests"] = rollout_gen - out["generate"]
    out["handoff"] = max(0.0, get("time/rollout") - rollout_gen)
    out["train_other"] = max(0.0, train - out["train_compute"])
    out.update({key: get(key) for _, key in DETAILS})
    trainer_side = train + get("time/log_probs") + get("time/advantages")  # all inside the train_rollout call
    out["ray_train"] = max(0.0, get("time/train_call") - trainer_side) if "time/train_call" in record else 0.0
    manager = get("time/rollout_manager")  # 0 in records of runs before it was recorded
    out["manager_own"] = max(0.0, manager - rollout_gen) if manager else 0.0
    out["ray_rollout"] = max(0.0, get("time/rollout") - manager - get("time/rollout_offload")) if manager else 0.0
    out["trainer_rest"] = max(0.0, get("time/train_rollout") - trainer_side) if "time/train_rollout" in record else 0.0
    out["driver_cpu"] = get("time/driver_cpu")
    out["ray_sync"] = (max(0.0, get("time/weight_sync_call") - get("time/weight_sync"))
                       if "time/weight_sync_call" in record else 0.0)
    out["driver"] = out["iteration"] - sum(out[k] for _, k in COMPUTE + OVERHEAD if k != "driver")
    return out


def _without_save(steady: list[dict[str, float]], overhead) -> list[str]:
    """The steady iterations without a checkpoint save (the quick start saves at its last): their overhead
    over their time, and per iteration. [] when every steady iteration saved."""
    kept = [p for p in steady if not p["time/save"]]
    if not kept or len(kept) == len(steady):
        return []
    share = 100 * sum(overhead(p) for p in kept) / sum(p["iteration"] for p in kept)
    each = " / ".join(f"{100 * overhead(p) / p['iteration']:.1f}" for p in kept)
    return [f"the {len(kept)} steady iterations without a save: overhead {share:.1f}% of their time (each: {each}%)"]


def report(records: list[dict[str, float]]) -> str:
    """Per-phase table: first iteration, mean of the steady ones, and the fastest steady iteration (the one
    least disturbed by other load on the machine: its split is the closest to the intrinsic costs)."""
    steady = [phases(r) for r in records[1:]]
    first = phases(records[0])
    avg = {k: mean(p[k] for p in steady) for k in steady[0]}
    fastest = min(steady, key=lambda p: p["iteration"])
    lines = [f"| phase | first iteration s | steady mean s ({len(steady)} iterations) | share | fastest iteration s "
             "| share |", "|---|---|---|---|---|---|"]

    def row(label: str, key: str) -> None:
        lines.append(f"| {label} | {first[key]:.3f} | {avg[key]:.3f} | {100 * avg[key] / avg['iteration']:.1f}% "
                     f"| {fastest[key]:.3f} | {100 * fastest[key] / fastest['iteration']:.1f}% |")

    for label, key in COMPUTE + OVERHEAD:
        row(label, key)
    row("**iteration**", "iteration")
    lines.append("| *parts of the above* | | | | | |")
    for label, key in DETAILS:
        row(f"*{label}*", key)

    def overhead(p: dict[str, float]) -> float:
        return p["iteration"] - sum(p[k] for _, k in COMPUTE)

    lines += ["", "overhead = iteration - (engine generate + trainer log-probs + trainer fwd/bwd/opt): "
              f"steady mean {overhead(avg):.3f} s = {100 * overhead(avg) / avg['iteration']:.1f}%, fastest iteration "
              f"{overhead(fastest):.3f} s = {100 * overhead(fastest) / fastest['iteration']:.1f}%, first iteration "
              f"{100 * overhead(first) / first['iteration']:.1f}% (goal <= 10%)",
              *_without_save(steady, overhead),
              "with log-prob recomputation counted as overhead too: steady mean "
              f"{100 * (overhead(avg) + avg['time/log_probs']) / avg['iteration']:.1f}%, fastest "
              f"{100 * (overhead(fastest) + fastest['time/log_probs']) / fastest['iteration']:.1f}%"]
    tok = mean(r.get("rollout/response_tokens", 0.0) for r in records[1:])
    train_tok = mean(r.get("train/tokens", 0.0) for r in records[1:])
    synced = mean(r.get("weight_sync/bytes", 0.0) for r in records[1:]) / 2**20
    lines.append(f"per steady iteration: {tok:.0f} generated tokens ({tok / avg['generate']:.0f} tokens/s in generate), "
                 f"{train_tok:.0f} trained tokens ({train_tok / max(avg['train_compute'], 1e-9):.0f} tokens/s in fwd/bwd/opt), "
                 f"{synced:.1f} MiB synced")
    return "\n".join(lines)


CACHED = ("model", "eval.jsonl", "data.jsonl")  # what the scripts write once and reuse when present


def run_quick_start(a: argparse.Namespace, out_dir: str) -> float:
    """The quick-start script with RUN_DIR=out_dir; the tiny checkpoint and data come from (and are kept in)
    --run-dir. Returns the wall time of the whole script."""
    for name in CACHED:
        if os.path.exists(os.path.join(a.run_dir, name)):
            os.symlink(os.path.join(a.run_dir, name), os.path.join(out_dir, name))
    env = dict(os.environ, RUN_DIR=out_dir, NUM_ROLLOUT=str(a.num_rollout), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    cmd = ["bash", a.script, *a.extra]
    log_path = os.path.join(out_dir, "quick_start.log")
    print(f"running: RUN_DIR={out_dir} NUM_ROLLOUT={a.num_rollout} {' '.join(cmd)}\n  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_profilers = _attach_profiler(a, proc.pid) if a.profile else None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[rollout") or "Error" in line or "error:" in line:
                print("  " + line.rstrip()[:160], flush=True)
        rc = proc.wait()
        if wait_profilers is not None:
            wait_profilers()
    if rc != 0:
        sys.exit(f"{os.path.basename(a.script)} failed (exit code {rc}); see {log_path}")
    for name in CACHED:
        made = os.path.join(out_dir, name)
        if os.path.exists(made) and not os.path.islink(made) and not os.path.exists(os.path.join(a.run_dir, name)):
            shutil.move(made, os.path.join(a.run_dir, name))
    return time.perf_counter() - t0


PROFILED = {"driver": "train.py", "trainer": "ray::MegatronTrainRayActor", "rollout-manager": "ray::RolloutManager",
            "engine": "slime.backends.embedded"}


def _attach_profiler(a: argparse.Namespace, script_pid: int):
    """One `py-spy record --nonblocking` per process of the run (driver, trainer actor, rollout manager,
    engine), attached as each appears among the script's descendants; writes PROFILE.<role>.txt.
    (py-spy's --subprocesses does not follow through the bash script and raylet.)"""
    import threading

    import psutil

    spies: list[subprocess.Popen] = []
    done = threading.Event()

    def role_of(proc: psutil.Process) -> str | None:
        cmd = " ".join(proc.cmdline())
        for role, key in PROFILED.items():
            if key in cmd and (role != "driver" or cmd.split(" ")[1:2] == ["train.py"]):
                return role
        return None

    def attach() -> None:
        seen: set[str] = set()
        while not done.is_set() and len(seen) < len(PROFILED):
            try:
                kids = psutil.Process(script_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for k in kids:
                try:  # py-spy cannot read an interpreter that is still starting: wait a moment
                    role = role_of(k) if time.time() - k.create_time() > 2.0 else None
                except psutil.Error:
                    continue
                if role and role not in seen:
                    seen.add(role)
                    with open(f"{a.profile}.{role}.log", "w") as log:
                        spies.append(subprocess.Popen(
                            [a.py_spy, "record", "--nonblocking", "--format", "raw", "--rate", str(a.profile_rate),
                             "--output", f"{a.profile}.{role}.txt", "--pid", str(k.pid)],
                            stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.05)

    t = threading.Thread(target=attach, daemon=True)
    t.start()

    def wait() -> None:
        done.set()
        t.join(10)
        for spy in spies:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.terminate()
    return wait


def _read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steady_records(out_dir: str) -> list[dict[str, float]]:
    """The iterations' records (the evaluations' records, kind "eval", left out)."""
    records = [r for r in _read_metrics(out_dir) if r.get("kind") != "eval"]
    if len(records) < 2:
        sys.exit(f"only {len(records)} iterations in {out_dir}/run/metrics.jsonl; need >= 2")
    return records


def driver_scaling(a: argparse.Namespace) -> None:
    """The driver's own CPU time per iteration at several rollout sizes, each against the first size of the
    same run: flat when no sample passes through the driver (the rollout manager hands the trainer ranks an
    object reference) and its waits do not wake up while the remote work runs (slime/ray/waiting.py)."""
    rows, base = [], None
    for size in [int(x) for x in a.driver_scaling.split(",")]:
        if size % 8:
            sys.exit(f"--driver-scaling: {size} samples is not a multiple of 8 samples per prompt")
        out_dir = os.path.join(a.run_dir, time.strftime(f"bench-{size}-%Y%m%d-%H%M%S"))
        os.makedirs(out_dir)
        sized = argparse.Namespace(**vars(a))
        sized.extra = [*a.extra, "--rollout-batch-size", str(size // 8), "--n-samples-per-prompt", "8",
                       "--rollout-max-response-len", "8", "--global-batch-size", str(size)]
        run_quick_start(sized, out_dir)
        steady = _steady_records(out_dir)[1:]
        cpu = mean(r.get("time/driver_cpu", float("nan")) for r in steady)
        it = mean(r["time/iteration"] for r in steady)
        base = base if base is not None else (size, cpu)
        rows.append(f"| {size} | {cpu * 1e3:.2f} | {cpu / base[1]:.2f}x | {it:.1f} | {cpu * 1e3 / it:.3f} |")
    print(f"\ndriver CPU time (time/driver_cpu: CPU time of the driver's loop thread, Ray calls included), mean of "
          f"{a.num_rollout - 1} steady iterations; ratio against {base[0]} samples in this run\n"
          "| samples per rollout | driver CPU ms per iteration | vs the first size | iteration s | "
          "driver CPU ms per iteration second |\n|---|---|---|---|---|")
    print("\n".join(rows))


def eval_line(records: list[dict]) -> str | None:
    """The held-out evaluations' time (outside the iterations), None when the run evaluated nothing."""
    evals = [sum(v for k, v in r.items() if k.startswith("time/eval_") and isinstance(v, (int, float)))
             for r in records if r.get("kind") == "eval"]
    if not evals:
        return None
    return (f"held-out evaluations (outside the iterations above): {len(evals)}, {mean(evals):.3f} s each on "
            f"average, {sum(evals):.3f} s in all")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.makedirs(a.run_dir, exist_ok=True)
    if a.driver_scaling:
        driver_scaling(a)
        return
    out_dir = os.path.join(a.run_dir, time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir)
    load_before = os.getloadavg()[0]
    wall = run_quick_start(a, out_dir)
    records = _steady_records(out_dir)
    print()
    print(f"{a.model}: {os.path.relpath(a.script, ROOT)}; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(report(records))
    print(eval_line(_read_metrics(out_dir)) or "no held-out evaluation in this run")
    print(f"whole run (start-up, {len(records)} iterations, report): {wall:.0f} s; metrics: {out_dir}/run/metrics.jsonl")
    if a.profile:
        print(f"py-spy profiles (raw): {a.profile}.<{'|'.join(PROFILED)}>.txt; summarize with "
              f"python benchmarks/profile_summary.py FILE")


if __name__ == "__main__":
    main()
