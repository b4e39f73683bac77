"""`python -m slime.accelerator`: show the detected accelerator and run a small smoke check.

    --name   print only the detected accelerator's name (cpu | cuda | npu): run scripts pick their profile by it
    --env    print KEY=VALUE lines of the device environment a job's workers need on this node (allocator,
             collectives, task queue); the per-worker visible-device pinning is left to the trainer
    With both, the name comes first, then the KEY=VALUE lines.
"""

from __future__ import annotations

import argparse
import sys

from slime.accelerator import AcceleratorUnavailable, get_accelerator


def job_env(acc) -> dict[str, str]:
    """worker_env for all local devices, minus the visible-devices pinning (set per worker by slime itself)."""
    env = acc.worker_env(list(range(max(acc.device_count(), 1))))
    for key in (acc.visible_devices_env, getattr(acc, "ray_noset_env", None)):
        if key:
            env.pop(key, None)
    return env


def smoke(acc) -> int:
    import torch

    print(f"accelerator: {acc.describe()}")
    dev = acc.device()
    a = torch.randn(64, 64, device=dev)
    b = torch.randn(64, 64, device=dev)
    err = (a @ b - (a.double() @ b.double()).to(a.dtype)).abs().max().item()
    acc.synchronize()
    stats = acc.memory_stats()
    print(f"matmul max error vs float64: {err:.2e}")
    print("memory: " + ", ".join(f"{k}={v / 2**20:.0f} MiB" for k, v in stats.items()))
    return 0 if err < 1e-3 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slime.accelerator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", action="store_true", help="print the accelerator name")
    ap.add_argument("--env", action="store_true", help="print the job's device environment as KEY=VALUE lines")
    a = ap.parse_args(argv)
    try:
        acc = get_accelerator()
        if a.name:
            print(acc.name)
        if a.env:
            for k, v in sorted(job_env(acc).items()):
                print(f"{k}={v}")
        if a.name or a.env:
            return 0
    except AcceleratorUnavailable as e:
        print(f"slime: {e}", file=sys.stderr)
        return 2
    return smoke(acc)


if __name__ == "__main__":
    sys.exit(main())
