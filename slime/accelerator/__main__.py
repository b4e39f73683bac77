"""`python -m slime.accelerator`: show the detected accelerator and run a small smoke check.

    --name   print only the detected accelerator's name (cpu | cuda | npu): run scripts pick their profile by it
    --env    print KEY=VALUE lines of the device environment a job's workers need on this node (allocator,
             collectives, task queue); the per-worker visible-device pinning is left to the trainer
    --patches  list every accelerator's patch sets (per library: each patch's name, targets, why,
             remove-when, versions) without applying anything; a library that is not installed is named
    --check-host  Ascend: the driver / CANN versions and every local NPU's RoCE link and IP (hccn_tool), the
             checks a multi-node run makes before Ray on its first node (run it on each node before `ray start`);
             one line and exit 2 on a problem. Other accelerators have none.
    With both --name and --env, the name comes first, then the KEY=VALUE lines.
"""

from __future__ import annotations

import argparse
import sys

from slime.accelerator import get_accelerator
from slime.accelerator.cli import one_line_errors


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


def patches_text() -> str:
    """Every registered patch set, grouped by accelerator then library (loads the sets, applies none)."""
    from slime.accelerator.patches import patch_set, registered_sets, upstream_ref
    from slime.accelerator.registry import accelerator_names

    lines: list[str] = []
    libraries = sorted({library for _, library in registered_sets()})
    for accelerator, library in [(a, lib) for a in accelerator_names() for lib in libraries]:
        try:
            patches = patch_set(accelerator, library)
        except ImportError as e:
            lines.append(f"[{accelerator}] {library}: not loadable here ({type(e).__name__}: {e})")
            continue
        lines.append(f"[{accelerator}] {library}: {len(patches)} patches")
        for p in patches:
            extra = " (adds the attribute if missing)" if p.add_if_missing else ""
            lines.append(f"  {p.name}  [{p.versions}]{extra}")
            lines.extend(f"    target: {t}" for t in p.targets)
            lines.append(f"    why: {p.why}")
            lines.append(f"    replaces: {p.replaces}")
            lines.append(f"    remove when: {p.remove_when}")
            lines.append(f"    upstream: {upstream_ref(p, library)}")
    return "\n".join(lines)


def check_host(acc) -> int:
    from slime.accelerator.ascend import AscendAccelerator
    from slime.accelerator.ascend.host_checks import visible_device_ids
    from slime.accelerator.base import DeviceConfigError

    if not isinstance(acc, AscendAccelerator) or acc.simulated:
        print(f"no host checks for {acc.describe()}")
        return 0
    try:
        print(acc.check_host(True, visible_device_ids(acc.device_count())))
    except DeviceConfigError as e:
        print(f"slime: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slime.accelerator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", action="store_true", help="print the accelerator name")
    ap.add_argument("--env", action="store_true", help="print the job's device environment as KEY=VALUE lines")
    ap.add_argument("--patches", action="store_true", help="list every accelerator's patch sets")
    ap.add_argument("--record-fingerprints", action="store_true",
                    help="fingerprint the installed originals every patch replaces (after re-checking the rewrites "
                         "against a changed library) into slime/accelerator/patch_fingerprints.json")
    ap.add_argument("--check-host", action="store_true",
                    help="Ascend: check the driver / CANN versions and this node's NPU links (hccn_tool) as a "
                         "multi-node run does before Ray; one line, exit 2 on a problem")
    a = ap.parse_args(argv)
    if a.check_host:
        return check_host(get_accelerator())
    if a.record_fingerprints:
        from slime.accelerator.patches import FINGERPRINTS_PATH, record_fingerprints

        table = record_fingerprints()
        print(f"{sum(len(t) for lib in table.values() for t in lib.values())} fingerprints in {FINGERPRINTS_PATH}")
        return 0
    if a.patches:
        print(patches_text())
        return 0
    acc = get_accelerator()
    if a.name:
        print(acc.name)
    if a.env:
        for k, v in sorted(job_env(acc).items()):
            print(f"{k}={v}")
    if a.name or a.env:
        return 0
    return smoke(acc)


if __name__ == "__main__":
    sys.exit(main())
