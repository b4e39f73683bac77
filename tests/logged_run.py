"""subprocess.run for whole runs (train.py and the like) that, when the run overstays its timeout, fails the test
with where each of its processes waited: the run gets SLIME_DUMP_STACKS_AFTER_S (slime/utils/stack_dump.py) a
little under the timeout, so its driver, actors and engines print their stacks before it is killed, and the
failure shows the tail of its output instead of pytest's one-line repr of a TimeoutExpired."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

TAIL_CHARS = 20000


def run_logged(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, **kwargs):
    env = dict(os.environ if env is None else env)
    env.setdefault("SLIME_DUMP_STACKS_AFTER_S", str(max(timeout - 45, timeout * 0.8)))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{os.path.basename(cmd[1]) if len(cmd) > 1 else cmd[0]} still running after {timeout:.0f} s "
                    f"(killed)\n--- stdout tail ---\n{out[-4000:]}\n--- stderr tail (stacks) ---\n{err[-TAIL_CHARS:]}",
                    pytrace=False)


def run_failure(proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """What a failed whole run printed, as one string (pytest shortens a tuple's repr to a few hundred
    characters): its stdout and stderr tails, then the tail of every Ray actor log its error lines name
    ("(actor log: PATH)"), which is where an actor that died mid-run wrote why."""
    text = f"exit {proc.returncode}\n--- stdout tail ---\n{(proc.stdout or '')[-tail:]}\n" \
           f"--- stderr tail ---\n{(proc.stderr or '')[-tail:]}"
    for path in dict.fromkeys(re.findall(r"\(actor log: ([^)\s]+)\)", (proc.stdout or "") + (proc.stderr or ""))):
        try:
            with open(path, errors="replace") as f:
                text += f"\n--- {path} (tail) ---\n{f.read()[-tail:]}"
        except OSError as e:
            text += f"\n--- {path}: unreadable ({e}) ---"
    return text


def run_train(argv: list[str], *, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    """`python train.py ARGV` from the repository root as the whole-run tests launch it: a Ray cluster of its own
    (no RAY_ADDRESS), no Ray auth or usage stats, one CPU thread per process, tests/ on PYTHONPATH (plugins named
    `test_module.function` import in every actor), `extra_env` on top. Fails the test with the run's output tails
    (run_failure) when it exits non-zero."""
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_CPU_THREADS="1",
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]), **extra_env)
    env.pop("RAY_ADDRESS", None)
    root = os.path.dirname(tests)
    proc = run_logged([sys.executable, os.path.join(root, "train.py"), *argv], env=env, cwd=root, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(run_failure(proc), pytrace=False)
    return proc
