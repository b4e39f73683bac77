"""Summarize a py-spy raw profile (`py-spy record --format raw [--subprocesses]`): samples per process and
the frames with the most inclusive samples.

    python benchmarks/profile_summary.py PROFILE [--match TEXT] [--top 30] [--per-process]

--match keeps only stacks containing TEXT (e.g. "WeightSync.sync"); shares are of the kept samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append((stack.split(";"), int(count)))
    return stacks


def _frame(f: str) -> str:
    return re.sub(r":\d+\)$", ")", f)  # one entry per function, not per line


def _process(f: str) -> str:
    m = re.match(r'process (\d+):"(.*)"', f)
    if not m:
        return f[:60]
    cmd = m.group(2)
    for key in ("slime.backends.embedded", "synthetic_glm", "MegatronTrainRayActor", "RolloutManager", "train.py",
                "weight_sync.py", "rl_iteration.py", "raylet", "gcs_server", "default_worker"):
        if key in cmd:
            return f"{m.group(1)} {key}"
    return f"{m.group(1)} {cmd[:50]}"


def summarize(stacks: list[tuple[list[str], int]], match: str | None, top: int) -> str:
    kept = [(s, n) for s, n in stacks if not match or any(match in f for f in s)]
    total = sum(n for _, n in kept) or 1
    procs: Counter = Counter()
    incl: Counter = Counter()
    for frames, n in kept:
        if frames and frames[0].startswith("process "):
            procs[_process(frames[0])] += n
        for f in {_frame(f) for f in frames if not f.startswith("process ")}:
            incl[f] += n
    lines = [f"{total} samples" + (f" in stacks containing {match!r}" if match else "")]
    lines += [f"  {100 * n / total:5.1f}%  process {p}" for p, n in procs.most_common(8)]
    lines += [f"  {100 * n / total:5.1f}%  {f[:140]}" for f, n in incl.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--match", default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--per-process", action="store_true", help="one summary per process")
    a = ap.parse_args()
    stacks = read_stacks(a.profile)
    if not a.per_process:
        print(summarize(stacks, a.match, a.top))
        return
    by_proc = defaultdict(list)
    for frames, n in stacks:
        by_proc[_process(frames[0]) if frames and frames[0].startswith("process ") else "?"].append((frames, n))
    for proc, items in sorted(by_proc.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        print(f"== {proc}")
        print(summarize(items, a.match, a.top))


if __name__ == "__main__":
    main()
