"""Device profiles for the planner: the one table of device numbers and where each comes from.

Capacities are the vendor's "GB" taken as 1e9 bytes (conservative: the runtimes report a little more,
e.g. an H100 80GB shows ~79.6 GiB). Figures marked in `assumed` are not published and are stated
as assumptions; change them here when a datasheet appears. docs/planner.md mirrors this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class DeviceProfile:
    key: str
    name: str
    memory_gb: float  # HBM per device (one torch device)
    hbm_tb_s: float  # HBM bandwidth per device
    bf16_tflops: float  # dense BF16 peak per device
    link_gb_s: float  # device-to-device interconnect per device (one direction)
    devices_per_node: int
    source: str
    ipc: bool = True  # cross-process device memory sharing (colocated weight sync without a copy)
    assumed: tuple[str, ...] = field(default_factory=tuple)  # fields that are assumptions, not published

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    def row(self) -> list[str]:
        def mark(f: str, v: str) -> str:
            return f"{v}*" if f in self.assumed else v

        return [self.key, self.name, mark("memory_gb", f"{self.memory_gb:g}"), mark("hbm_tb_s", f"{self.hbm_tb_s:g}"),
                mark("bf16_tflops", f"{self.bf16_tflops:g}"), mark("link_gb_s", f"{self.link_gb_s:g}"),
                mark("devices_per_node", str(self.devices_per_node)), self.source]


_HC2025 = "Huawei Connect 2025 Ascend roadmap keynote (2025-09), press figures"
DEVICES: dict[str, DeviceProfile] = {
    p.key: p
    for p in (
        DeviceProfile("950dt", "Ascend 950DT", 144, 4.0, 500, 2000, 8,
                      f"{_HC2025}: 144 GB HiZQ 2.0 at 4 TB/s, 1 PFLOPS FP8, 2 TB/s interconnect, Q4 2026; "
                      "Ascend PyTorch IPC notes: no IPC on 950DT",
                      ipc=False, assumed=("bf16_tflops", "link_gb_s", "devices_per_node")),
        DeviceProfile("950pr", "Ascend 950PR (Atlas 350)", 112, 1.4, 500, 2000, 8,
                      "Atlas 350 card as shipped (2026-03), press figures: 112 GB HBM at 1.4 TB/s, 600 W "
                      f"(the roadmap said 128 GB / 1.6 TB/s); {_HC2025}: 1 PFLOPS FP8, 2 TB/s interconnect",
                      assumed=("bf16_tflops", "link_gb_s", "devices_per_node")),
        DeviceProfile("a3", "Atlas A3 (Ascend 910C, one die = one device)", 64, 1.6, 390, 200, 16,
                      "910C package ~128 GB, ~3.2 TB/s, ~780 TFLOPS BF16 (public reporting) halved per die; "
                      "MindCluster docs: 16 processors per Atlas 800T A3 server, two per HiAM module",
                      assumed=("link_gb_s",)),
        DeviceProfile("h100", "NVIDIA H100 SXM5", 80, 3.35, 989, 450, 8,
                      "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense, NVLink 900 GB/s bidirectional"),
        DeviceProfile("h200", "NVIDIA H200 SXM", 141, 4.8, 989, 450, 8,
                      "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS BF16 dense, NVLink 900 GB/s bidirectional"),
    )
}
ASSUMPTION_NOTE = ("* = assumption: Ascend 950 BF16 taken as half the published FP8 rate, 8 devices per node, "
                   "2 TB/s interconnect used as one-direction figure; A3 per-die link bandwidth not published")

def get_device(key: str) -> DeviceProfile:
    k = key.strip().lower()
    if k not in DEVICES:
        raise ValueError(f"unknown device profile {key!r}; choose one of {', '.join(DEVICES)} (see slime/plan/devices.py)")
    return DEVICES[k]


def device_table() -> tuple[list[str], list[list[str]]]:
    header = ["key", "device", "GB", "HBM TB/s", "BF16 TFLOPS", "link GB/s", "per node", "source"]
    return header, [p.row() for p in DEVICES.values()]
