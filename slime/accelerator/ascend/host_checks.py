"""Start-up checks of an Ascend host, before Ray: the driver (HDK) and CANN versions against what the installed
torch_npu needs, and for a multi-node run each device's RoCE link and IP (hccn_tool). Each problem is one line
naming the fix (HostCheckError, which train.py prints and exits 2 on).

Facts used (slime/accelerator/ascend/support.py, shared/notes torch-npu-contracts.md):
- torch_npu X pairs with one CANN release (PTA_RELEASES: e.g. 2.12.0 -> Ascend PyTorch 26.1.0 -> CANN 9.1.0).
- torch_npu's NPU IPC (colocated weight sync) needs PTA 7.2.0+, CANN 8.3.RC1+ and HDK 25.3.RC1+: the oldest driver
  the release notes name for the stack slime supports. CANN 9.x's release notes pair it with a newer HDK per chip;
  slime does not know that number, so only the documented floor is enforced.
- The driver writes /usr/local/Ascend/driver/version.info (`Version=25.3.rc1`, ...); a container sees it only when
  it is mounted (vllm-ascend's and SGLang's Ascend docs mount it read-only with driver/lib64).
- The CANN toolkit records its version in <toolkit>/latest/<arch>-linux/ascend_toolkit_install.info
  (`version=9.1.0`); set_env.sh exports ASCEND_TOOLKIT_HOME.
- `hccn_tool -i <id> -link -g` prints `link status: UP|DOWN`, `hccn_tool -i <id> -ip -g` prints `ipaddr:<a.b.c.d>`
  for a device's RoCE port; HCCL between nodes needs both on every device.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from slime.accelerator.ascend.support import PTA_RELEASES, release_of
from slime.accelerator.base import DeviceConfigError

DRIVER_INFO = "usr/local/Ascend/driver/version.info"
TOOLKIT_HOME = "usr/local/Ascend/ascend-toolkit/latest"
HCCN_TOOL = ("usr/local/Ascend/driver/tools/hccn_tool", "usr/local/bin/hccn_tool")
IPC_MIN_HDK = "25.3.RC1"
GUIDE = "docs/ascend.md"


class HostCheckError(DeviceConfigError):
    """One line: what is wrong on this host and how to fix it."""


@dataclass(frozen=True)
class HostFacts:
    root: str = "/"  # tests point it at a fake tree
    env: dict | None = None  # ASCEND_TOOLKIT_HOME etc. (default os.environ)

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)


def version_key(version: str) -> tuple[int, ...]:
    """'25.3.rc1' / '25.3.RC1' / '9.1.0' / '26.0.rc1.b020' -> comparable: its numbers, a release candidate before its
    release (-1, n); build suffixes are ignored."""
    parts: list[int] = []
    for token in re.split(r"[.\-]", version.strip().lower()):
        if token.isdigit():
            parts.append(int(token))
        elif re.fullmatch(r"rc\d+", token):
            parts.extend((-1, int(token[2:])))
    return tuple(parts)


def _key_value(path: str, key: str) -> str | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            name, _, value = line.partition("=")
            if name.strip().lower() == key.lower() and value.strip():
                return value.strip()
    return None


def driver_version(facts: HostFacts) -> str:
    path = facts.path(DRIVER_INFO)
    if not os.path.isfile(path):
        raise HostCheckError(f"/{DRIVER_INFO} not found: the Ascend driver is not installed or not visible in this "
                             f"container; install the HDK on the host and mount /usr/local/Ascend/driver read-only "
                             f"(see {GUIDE}, Container set-up)")
    version = _key_value(path, "Version") or _key_value(path, "package_version")
    if not version or not re.match(r"^\d+\.\d+", version):
        raise HostCheckError(f"/{DRIVER_INFO} has no Version=<x.y...> line; reinstall the Ascend HDK driver")
    return version


def toolkit_version(facts: HostFacts) -> str | None:
    """CANN's version from ascend_toolkit_install.info, or None when no toolkit is found (checked elsewhere: import)."""
    env = os.environ if facts.env is None else facts.env
    home = env.get("ASCEND_TOOLKIT_HOME")
    roots = [os.path.join(facts.root, home.lstrip("/"))] if home else []
    roots.append(facts.path(TOOLKIT_HOME))
    for root in roots:
        for info in sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info"))):
            version = _key_value(info, "version")
            if version:
                return version
    return None


def check_versions(facts: HostFacts, torch_npu_version: str) -> None:
    """The driver is at least the documented floor; CANN is the release the installed torch_npu pairs with."""
    driver = driver_version(facts)
    if version_key(driver) < version_key(IPC_MIN_HDK):
        raise HostCheckError(f"Ascend driver (HDK) {driver} is older than {IPC_MIN_HDK}, the oldest torch_npu's "
                             f"IPC and CANN 8.3.RC1+ are documented with; upgrade the HDK driver and firmware to the "
                             f"release your CANN's release notes name for this chip (see {GUIDE})")
    release = release_of(torch_npu_version)
    cann = toolkit_version(facts)
    if release is None or cann is None:
        return
    want = PTA_RELEASES[release][1]
    if version_key(cann) != version_key(want):
        raise HostCheckError(f"CANN {cann} is installed but torch_npu {torch_npu_version} (Ascend PyTorch {release}) "
                             f"pairs with CANN {want}; install CANN {want} or the torch_npu of CANN {cann} "
                             f"(support.PTA_RELEASES, {GUIDE})")


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    return (done.stdout or "") + (done.stderr or "")


def hccn_tool(facts: HostFacts) -> str | None:
    for candidate in HCCN_TOOL:
        if os.access(facts.path(candidate), os.X_OK):
            return facts.path(candidate)
    return None


def check_links(facts: HostFacts, device_ids: Sequence[int], run: Runner = _run) -> None:
    """Every device's RoCE port is UP and has an IP (multi-node HCCL goes over them)."""
    tool = hccn_tool(facts)
    if tool is None:
        raise HostCheckError(f"hccn_tool not found (/{HCCN_TOOL[0]}): a multi-node run checks each NPU's RoCE link "
                             f"with it; mount /usr/local/Ascend/driver/tools/hccn_tool into the container (see {GUIDE})")
    for dev in device_ids:
        link = run([tool, "-i", str(dev), "-link", "-g"])
        status = re.search(r"link status:\s*(\w+)", link, re.IGNORECASE)
        if not status or status.group(1).upper() != "UP":
            state = status.group(1) if status else "unknown"
            raise HostCheckError(f"NPU {dev}: RoCE link {state} (`hccn_tool -i {dev} -link -g`); multi-node HCCL needs "
                                 f"every device's link UP: check the cable / switch port, then "
                                 f"`hccn_tool -i {dev} -link -g` again")
        ip = re.search(r"ipaddr:\s*(\d+\.\d+\.\d+\.\d+)", run([tool, "-i", str(dev), "-ip", "-g"]))
        if not ip:
            raise HostCheckError(f"NPU {dev}: no RoCE IP address (`hccn_tool -i {dev} -ip -g`); set one with "
                                 f"`hccn_tool -i {dev} -ip -s address <ip> netmask <mask>`")


def visible_device_ids(default_count: int, env: dict | None = None) -> list[int]:
    """The physical device ids this node's workers use: ASCEND_RT_VISIBLE_DEVICES, else 0..default_count-1."""
    value = (os.environ if env is None else env).get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if value:
        return [int(v) for v in value.split(",") if v.strip()]
    return list(range(default_count))


def check_node(torch_npu_version: str, device_ids: Sequence[int], multi_node: bool, facts: HostFacts = HostFacts()) -> str:
    """Every check of this node (the links only for a multi-node run); a one-line summary when all pass."""
    check_versions(facts, torch_npu_version)
    if multi_node:
        check_links(facts, device_ids)
    cann = toolkit_version(facts) or "not found"
    links = f", RoCE link UP with an IP on NPU {','.join(map(str, device_ids))}" if multi_node else ""
    return f"host checks passed: driver {driver_version(facts)}, CANN {cann}, torch_npu {torch_npu_version}{links}"
