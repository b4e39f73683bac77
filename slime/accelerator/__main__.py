"""`python -m slime.accelerator`: show the detected accelerator and run a small smoke check."""

from __future__ import annotations

import sys

import torch

from slime.accelerator import AcceleratorUnavailable, get_accelerator


def main() -> int:
    try:
        acc = get_accelerator()
    except AcceleratorUnavailable as e:
        print(f"slime: {e}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
