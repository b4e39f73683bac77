"""What the installed Ascend stack supports: the torch_npu release table and per-SoC op documentation.

- `PTA_RELEASES`: Ascend Extension for PyTorch ("PTA", op-plugin branch) release -> (torch_npu wheels,
  CANN), from the Ascend/pytorch release notes. `release_of(torch_npu.__version__)` places an installed
  wheel in it; each op mapping's `since` is compared with that release.
- `DOCUMENTED_SOCS`: the SoCs each kernel's torch_npu API page lists. torch_npu runs 950-class SoCs
  aclnn-only, so a kernel without a 950 build fails at its first call; an undocumented (op, SoC) pair is
  not refused, but the one-time probe (ops.py) decides, and its result is logged.
"""

from __future__ import annotations

import re

PTA_RELEASES: dict[str, tuple[str, str]] = {
    "6.0.0": ("2.1.0.post10, 2.3.1.post4, 2.4.0.post2", "8.0.0"),
    "7.0.0": ("2.1.0.post12, 2.3.1.post6, 2.4.0.post4, 2.5.1", "8.1.RC1"),
    "7.1.0": ("2.1.0.post13, 2.5.1.post1, 2.6.0", "8.2.RC1"),
    "7.2.0": ("2.1.0.post17, 2.6.0.post3, 2.7.1, 2.8.0", "8.3.RC1"),
    "7.3.0": ("2.9.0, 2.8.0.post2, 2.7.1.post2, 2.6.0.post5", "8.5.0"),
    "26.0.0": ("2.9.0.post2", "9.0.0"),
    "26.1.0": ("2.10.0.post4, 2.11.0, 2.12.0", "9.1.0"),
}
OLDEST_RELEASE = "6.0.0"
NEWEST_RELEASE = "26.1.0"

# torch_npu API pages' "supported products" per kernel, where they leave out a SoC slime may run on.
# Kernels not listed here name every SoC slime targets (A2, A3, 950PR, 950DT).
DOCUMENTED_SOCS: dict[str, tuple[str, ...]] = {
    "npu_rms_norm": ("A2", "A3"),
    "npu_rotary_mul": ("A2", "A3"),
    "npu_moe_gating_top_k": ("A2", "A3"),
    "npu_fusion_attention": ("A2", "A3", "950DT"),
}


def release_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def _wheel_key(version: str) -> tuple[tuple[int, ...], int] | None:
    """'2.8.0.post2+git1' -> ((2, 8, 0), 2); None if it does not look like a torch_npu wheel version."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", version.strip())
    if not m:
        return None
    return (int(m[1]), int(m[2]), int(m[3])), int(m[4] or 0)


def release_of(torch_npu_version: str) -> str | None:
    """The Ascend PyTorch release of an installed torch_npu: the exact wheel's release; else, for a later
    post-release of a listed wheel, the newest release not after it; a wheel newer than every listed
    one counts as the newest release. None when the table cannot place it (older or unknown)."""
    key = _wheel_key(torch_npu_version)
    if key is None:
        return None
    best: str | None = None
    newest_base = max(_wheel_key(w)[0] for wheels, _ in PTA_RELEASES.values() for w in wheels.split(", "))
    for release in sorted(PTA_RELEASES, key=release_key):
        for wheel in PTA_RELEASES[release][0].split(", "):
            base, post = _wheel_key(wheel)
            if base == key[0] and post <= key[1]:
                best = release
    if best is None and key[0] > newest_base:
        return NEWEST_RELEASE
    return best


def requirement(release: str) -> str:
    wheels, cann = PTA_RELEASES[release]
    return f"Ascend PyTorch {release} (torch_npu {wheels}; CANN {cann})"


def soc_of(device_name: str) -> str:
    """'Ascend950PR' -> '950PR', 'Ascend950DT' -> '950DT', 'Ascend910_9392' -> 'A3', 'Ascend910B3' -> 'A2';
    anything else is returned as given (or 'unknown')."""
    name = device_name or ""
    for tag in ("950DT", "950PR"):
        if tag in name:
            return tag
    if "950" in name:
        return "950"
    if "910_93" in name:
        return "A3"
    if "910B" in name:
        return "A2"
    return name.strip() or "unknown"


def is_950(soc: str) -> bool:
    return soc.startswith("950")


def documented_on(kernel: str, soc: str) -> bool:
    socs = DOCUMENTED_SOCS.get(kernel)
    return socs is None or soc in socs
