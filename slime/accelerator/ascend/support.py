"""What the installed Ascend stack supports: the torch_npu release table and per-SoC op documentation.

- `PTA_RELEASES`: Ascend Extension for PyTorch ("PTA", op-plugin branch) release -> (torch_npu wheels,
  CANN), from the Ascend/pytorch release notes; `WHEEL_RELEASES` places every published wheel in it.
  `release_of(torch_npu.__version__)` gives an installed wheel's release; each op mapping's `since` is
  compared with it.
- `DOCUMENTED_SOCS`: the SoCs each kernel's torch_npu API page lists. torch_npu runs 950-class SoCs
  aclnn-only, so a kernel without a 950 build fails at its first call; an undocumented (op, SoC) pair is
  not refused, but the one-time probe (ops.py) decides, and its result is logged.
"""

from __future__ import annotations

import re

PTA_RELEASES: dict[str, tuple[str, str]] = {
    "6.0.rc3": ("2.1.0.post8, 2.3.1.post2, 2.4.0", "8.0.RC3"),
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

# Every torch-npu cp311 x86_64 wheel on PyPI (tests/data/torch_npu_facts.json, read 2026-12-01) -> the release it
# counts as. A wheel the release notes list is that release; any other wheel (patch re-uploads such as
# 2.10.0.post2, 2.9.1, release candidates) counts as the newest release uploaded on or before it: kernels
# are only added, so that is a lower bound. tests/test_npu_wheel_facts.py derives this table again from
# the facts' upload dates and checks every mapping's kernels exist in each read wheel at or after its `since`.
_WHEELS_BY_RELEASE = {
    "6.0.rc3": "2.1.0.post8 2.3.1.post2 2.4.0 2.5.1rc1",
    "6.0.0": "2.1.0.post10 2.3.1.post4 2.4.0.post2",
    "7.0.0": "2.1.0.post12 2.3.1.post6 2.4.0.post4 2.5.1 2.6.0rc1 2.7.1rc1",
    "7.1.0": "2.1.0.post13 2.5.1.post1 2.6.0 2.8.0rc1 2.9.0rc1",
    "7.2.0": "2.1.0.post17 2.6.0.post3 2.7.1 2.8.0",
    "7.3.0": "2.6.0.post5 2.7.1.post2 2.8.0.post2 2.9.0 2.10.0rc1 2.10.0rc2 2.11.0rc1",
    "26.0.0": "2.7.1.post4 2.8.0.post4 2.9.0.post2 2.10.0 2.9.1 2.12.0rc1 2.7.1.post6 2.8.0.post5 2.9.0.post4 "
              "2.10.0.post2",
    "26.1.0": "2.7.1.post8 2.9.0.post6 2.10.0.post4 2.11.0 2.12.0 2.13.0rc1 2.7.1.post10 2.9.0.post8 2.10.0.post6 "
              "2.11.0.post2 2.12.0.post2 2.7.1.post11 2.9.0.post9 2.10.0.post7 2.11.0.post3 2.12.0.post3 2.13.0 2.14.0",
}
WHEEL_RELEASES: dict[str, str] = {w: r for r, ws in _WHEELS_BY_RELEASE.items() for w in ws.split()}

# torch_npu API pages' "supported products" per kernel, where they leave out a SoC slime may run on.
# Kernels not listed here name every SoC slime targets (A2, A3, 950PR, 950DT).
DOCUMENTED_SOCS: dict[str, tuple[str, ...]] = {
    "npu_rms_norm": ("A2", "A3"),
    "npu_rotary_mul": ("A2", "A3"),
    "npu_moe_gating_top_k": ("A2", "A3"),
    "npu_fusion_attention": ("A2", "A3", "950DT"),
}


def release_key(release: str) -> tuple[int, ...]:
    """'26.1.0' -> (26, 1, 0); '6.0.rc3' -> (6, 0, -1, 3): a release candidate sorts before its release."""
    parts: list[int] = []
    for p in release.lower().split("."):
        parts.extend((-1, int(p[2:])) if p.startswith("rc") else (int(p),))
    return tuple(parts)


def wheel_key(version: str) -> tuple[int, ...] | None:
    """'2.8.0.post2+git1' -> (2, 8, 0, 0, 2); '2.10.0rc1' -> (2, 10, 0, -1, 1); None if not a wheel version."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?(?:\.post(\d+))?", version.strip())
    if not m:
        return None
    base = (int(m[1]), int(m[2]), int(m[3]))
    return base + ((-1, int(m[4])) if m[4] else (0, int(m[5] or 0)))


def _clean(version: str) -> str:
    return re.split(r"[+\s]", version.strip(), maxsplit=1)[0]


def release_of(torch_npu_version: str) -> str | None:
    """The Ascend PyTorch release an installed torch_npu counts as. A published wheel: its entry in
    WHEEL_RELEASES. An unlisted one: the release of the newest listed wheel of the same torch minor (X.Y)
    not after it; a wheel of a torch minor newer than every listed one counts as the newest release.
    None when the table cannot place it (an unlisted minor older than the newest, or not a version)."""
    key = wheel_key(torch_npu_version)
    if key is None:
        return None
    exact = WHEEL_RELEASES.get(_clean(torch_npu_version))
    if exact is not None:
        return exact
    same_minor = [(wheel_key(w), r) for w, r in WHEEL_RELEASES.items() if wheel_key(w)[:2] == key[:2]]
    earlier = [(k, r) for k, r in same_minor if k <= key]
    if earlier:
        return max(earlier)[1]
    if key[:2] > max(wheel_key(w)[:2] for w in WHEEL_RELEASES):
        return NEWEST_RELEASE
    return None


def requirement(release: str) -> str:
    wheels, cann = PTA_RELEASES[release]
    return f"Ascend PyTorch {release} (torch_npu {wheels}; CANN {cann})"


# torch_npu up to 2.9.x names two 950-class chips Ascend910_9589 / Ascend910_9599 (torchair counts every
# "Ascend910_95*" as a 950); the SoC tables from 2.10.0.post4 (and 2.7.1.post8, 2.9.0.post6) name the same ids
# Ascend950PR_9589 / Ascend950PR_9599. Any other Ascend910_95* name is a 950 of unknown kind.
_ASCEND910_95_IDS = {"9589": "950PR", "9599": "950PR"}


def soc_of(device_name: str) -> str:
    """'Ascend950PR_9579' -> '950PR', 'Ascend950DT_95A1' -> '950DT', 'Ascend910_9599' -> '950PR',
    'Ascend950' -> '950', 'Ascend910_9392' -> 'A3', 'Ascend910B3' -> 'A2'; anything else as given (or
    'unknown')."""
    name = device_name or ""
    for tag in ("950DT", "950PR"):
        if tag in name:
            return tag
    m = re.search(r"Ascend910_(95\w*)", name)
    if m:
        return _ASCEND910_95_IDS.get(m[1][:4], "950")
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
