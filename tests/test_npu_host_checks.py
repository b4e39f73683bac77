"""Ascend start-up checks before Ray (slime/accelerator/ascend/host_checks.py) on fake host trees and a fake
hccn_tool, and HCCL_BUFFSIZE sized for the run and handed to the Ray workers (hccl_buffer.py) under the simulator."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from slime.accelerator.ascend import hccl_buffer, host_checks
from slime.accelerator.ascend.host_checks import HostCheckError, HostFacts

npu_sim = pytest.importorskip("npu_sim")
MIB = 1 << 20
GLM53 = {"model_type": "glm5_next", "hidden_size": 4096, "num_experts_per_tok": 8}


def _host(tmp_path, driver: str | None = "25.3.rc1", cann: str | None = "9.1.0", hccn: str | None = None) -> HostFacts:
    if driver is not None:
        info = tmp_path / host_checks.DRIVER_INFO
        info.parent.mkdir(parents=True)
        info.write_text(f"Version={driver}\nascendhal_version=7.35.19\npackage_version={driver}\n")
    if cann is not None:
        info = tmp_path / host_checks.TOOLKIT_HOME / "aarch64-linux" / "ascend_toolkit_install.info"
        info.parent.mkdir(parents=True)
        info.write_text(f"package_name=Ascend-cann-toolkit\nversion={cann}\ninnerversion=V100R001C26\n")
    if hccn is not None:  # a fake hccn_tool: `-i ID -link -g` / `-i ID -ip -g` answer from the script's table
        tool = tmp_path / host_checks.HCCN_TOOL[0]
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text("#!/bin/sh\n" + hccn)
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return HostFacts(root=str(tmp_path), env={})


def test_driver_and_cann_versions(tmp_path):
    facts = _host(tmp_path, driver="25.5.0", cann="9.1.0")
    assert host_checks.driver_version(facts) == "25.5.0" and host_checks.toolkit_version(facts) == "9.1.0"
    host_checks.check_versions(facts, "2.12.0")  # torch_npu 2.12.0 = Ascend PyTorch 26.1.0 = CANN 9.1.0
    assert host_checks.version_key("25.3.RC1") == host_checks.version_key("25.3.rc1") < host_checks.version_key("25.3.0")
    assert host_checks.version_key("26.0.rc1.b020") == (26, 0, -1, 1)


@pytest.mark.parametrize("driver,cann,torch_npu,needle", [
    (None, "9.1.0", "2.12.0", "version.info not found"),
    ("24.1.rc2", "9.1.0", "2.12.0", "older than 25.3.RC1"),
    ("25.2.0", "9.1.0", "2.12.0", "older than 25.3.RC1"),
    ("25.5.0", "9.0.0", "2.12.0", "pairs with CANN 9.1.0"),
    ("25.5.0", "8.5.0", "2.9.0.post2", "pairs with CANN 9.0.0"),
])
def test_version_problems_are_one_line_naming_the_fix(tmp_path, driver, cann, torch_npu, needle):
    with pytest.raises(HostCheckError) as e:
        host_checks.check_versions(_host(tmp_path, driver=driver, cann=cann), torch_npu)
    message = str(e.value)
    assert needle in message and "\n" not in message
    assert any(fix in message for fix in ("mount", "upgrade", "install")), message


def test_garbled_driver_file_and_unknown_cann(tmp_path):
    facts = _host(tmp_path, cann=None)
    host_checks.check_versions(facts, "2.12.0")  # no toolkit found: nothing to compare (import torch_npu checks it)
    (tmp_path / host_checks.DRIVER_INFO).write_text("ascendhal_version=7.35.19\n")
    with pytest.raises(HostCheckError, match="no Version="):
        host_checks.driver_version(facts)


_HCCN = """case "$3" in
  -link) [ "$2" = "{down}" ] && echo "link status: DOWN" || echo "link status: UP" ;;
  -ip) [ "$2" = "{noip}" ] && echo "hccn_tool: get ip fail" || echo "ipaddr:192.168.1.$2"; echo "netmask:255.255.255.0" ;;
esac
"""


def test_links_up_with_addresses(tmp_path):
    host_checks.check_links(_host(tmp_path, hccn=_HCCN.format(down=-1, noip=-1)), [0, 1, 7])


@pytest.mark.parametrize("down,noip,needle", [(3, -1, "NPU 3: RoCE link DOWN"), (-1, 1, "NPU 1: no RoCE IP")])
def test_link_problems_name_the_device(tmp_path, down, noip, needle):
    with pytest.raises(HostCheckError) as e:
        host_checks.check_links(_host(tmp_path, hccn=_HCCN.format(down=down, noip=noip)), [0, 1, 2, 3])
    assert needle in str(e.value) and "hccn_tool -i" in str(e.value) and "\n" not in str(e.value)


def test_missing_hccn_tool(tmp_path):
    with pytest.raises(HostCheckError, match="hccn_tool not found.*mount"):
        host_checks.check_links(_host(tmp_path), [0])


def test_visible_device_ids():
    assert host_checks.visible_device_ids(4, {}) == [0, 1, 2, 3]
    assert host_checks.visible_device_ids(8, {"ASCEND_RT_VISIBLE_DEVICES": "2,5"}) == [2, 5]


# --- HCCL_BUFFSIZE ------------------------------------------------------------------------------------------------

def _args(**kw) -> argparse.Namespace:
    base = dict(hf_config=GLM53, max_tokens_per_gpu=4096, tensor_model_parallel_size=8, sequence_parallel=True,
                expert_model_parallel_size=32, update_weight_buffer_size=512 * MIB, bf16=True,
                update_weight_mode="auto", actor_num_nodes=16, actor_num_gpus_per_node=8)
    return argparse.Namespace(**{**base, **kw})


def test_buffsize_fits_the_all_to_all_and_the_bucket_goes_in_rounds():
    # GLM-5.3-Flash on the 950 profile: 4096 tokens / TP 8 (sequence parallel) x top-8 x 4096 x 2 bytes = 32 MiB
    # all-to-all: CANN's default 200 MB holds it; the 512 MiB weight bucket is broadcast in 3 rounds.
    traffic = hccl_buffer.traffic_of(_args())
    assert traffic.moe_all_to_all == 512 * 8 * 4096 * 2 == 32 * MIB
    assert traffic.buffsize_mb() == hccl_buffer.DEFAULT_MB and traffic.bucket_rounds() == 3
    # Without sequence parallelism every rank sends its whole micro-batch: 256 MiB, then 8192 tokens: 512 MiB.
    assert hccl_buffer.traffic_of(_args(sequence_parallel=False)).buffsize_mb() == 256
    big = hccl_buffer.traffic_of(_args(sequence_parallel=False, max_tokens_per_gpu=8192))
    assert big.buffsize_mb() == 512 and big.bucket_rounds() == 1  # the bucket fits the buffer the all-to-all needs
    assert hccl_buffer.traffic_of(_args(expert_model_parallel_size=1)).moe_all_to_all == 0  # no all-to-all
    assert hccl_buffer.traffic_of(_args(sequence_parallel=False, max_tokens_per_gpu=65536)).buffsize_mb() \
        == hccl_buffer.CAP_MB  # 4 GiB: capped (2 x the value per communicator)
    vl = {"model_type": "qwen3_5_moe", "text_config": {"hidden_size": 2048, "num_experts_per_tok": 8}}
    assert hccl_buffer.traffic_of(_args(hf_config=vl, sequence_parallel=False)).moe_all_to_all == 4096 * 8 * 2048 * 2


@pytest.fixture
def sim_npu(monkeypatch):
    from slime.accelerator import get_accelerator, set_accelerator

    monkeypatch.delenv(hccl_buffer.ENV, raising=False)
    previous = get_accelerator()
    with npu_sim.activate(reuse_probes=True) as acc:
        set_accelerator(acc)
        try:
            yield acc
        finally:
            set_accelerator(previous)
            os.environ.pop(hccl_buffer.ENV, None)


def _worker_env() -> dict[str, str]:
    from slime.ray.placement_group import DeviceSlots

    slots = DeviceSlots(pg=None, bundle_indices=[0], device_ids=[0], node_ips=["127.0.0.1"], cpus_per_bundle=1.0,
                        share=1.0)
    return slots.actor_options(0)["runtime_env"]["env_vars"]


def test_ray_workers_get_the_sized_buffer(sim_npu):
    assert hccl_buffer.ENV not in _worker_env()  # before the run's arguments are known: CANN's default
    sim_npu.check_and_update_config(_args(sequence_parallel=False))  # simulated: no host checks
    assert _worker_env()[hccl_buffer.ENV] == "256"


def test_user_value_is_kept(sim_npu, monkeypatch):
    monkeypatch.setenv(hccl_buffer.ENV, "300")
    sim_npu.check_and_update_config(_args(sequence_parallel=False))
    assert _worker_env()[hccl_buffer.ENV] == "300" and os.environ[hccl_buffer.ENV] == "300"


def test_real_npu_checks_the_host_before_ray(sim_npu):
    """The non-simulated accelerator runs the host checks in check_and_update_config (train.py prints the line and
    exits 2 before Ray on DeviceConfigError): pointed at an empty tree, the missing driver is the one line."""
    from slime.accelerator import AscendAccelerator
    from slime.accelerator.base import DeviceConfigError

    real = AscendAccelerator()
    real.host_root = "/nonexistent"
    with pytest.raises(DeviceConfigError, match="driver/version.info not found"):
        real.check_and_update_config(_args())
    assert hccl_buffer.ENV not in os.environ  # nothing set for a run that does not start


def test_check_host_cli(tmp_path, sim_npu, capsys, monkeypatch):
    """`python -m slime.accelerator --check-host` (run on each worker node before `ray start`): the summary line, or
    one line and exit 2; nothing to check on other accelerators or the simulator."""
    from slime.accelerator import AscendAccelerator, CpuAccelerator, get_accelerator, set_accelerator
    from slime.accelerator.__main__ import main

    previous = get_accelerator()
    try:
        set_accelerator(CpuAccelerator())
        assert main(["--check-host"]) == 0 and "no host checks" in capsys.readouterr().out
        set_accelerator(sim_npu)
        assert main(["--check-host"]) == 0 and "no host checks" in capsys.readouterr().out
        real = AscendAccelerator()  # the simulator stands in for torch_npu; the host tree is fake
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
        for down, code, needle in [(-1, 0, "host checks passed: driver 25.5.0, CANN 9.1.0"), (1, 2, "NPU 1: RoCE link")]:
            real.host_root = str(_host(tmp_path / f"d{down}", driver="25.5.0", hccn=_HCCN.format(down=down, noip=-1)).root)
            set_accelerator(real)
            assert main(["--check-host"]) == code
            out = capsys.readouterr()
            assert needle in (out.out if code == 0 else out.err)
    finally:
        set_accelerator(previous)
