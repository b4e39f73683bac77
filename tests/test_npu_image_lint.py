"""docker/Dockerfile.npu against the facts slime's Ascend code is written to (no docker here: the file is parsed):
the base image's CANN is the one the pinned torch_npu wheel pairs with in slime's own release table
(slime/accelerator/ascend/support.py, re-derived from the wheels by tests/test_npu_wheel_facts.py); the pinned
torch_npu is a published wheel whose SoC table names the 950 chips; the sgl-kernel-npu tag is the one the KDA facts were read at and has every kernel
slime maps to it; its build target is a 950 SoC name that slime recognises and the chip tag of the base image."""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_docker_and_scripts import parse_dockerfile

from slime.accelerator.ascend import kda_ops
from slime.accelerator.ascend.support import PTA_RELEASES, WHEEL_RELEASES, release_of, soc_of

ROOT = Path(__file__).resolve().parent.parent
ARGS = parse_dockerfile(ROOT / "docker/Dockerfile.npu")["args"]
DATA = ROOT / "tests" / "data"


def test_cann_is_the_pinned_torch_npus_pairing():
    release = release_of(ARGS["TORCH_NPU_VERSION"])
    assert release is not None and ARGS["TORCH_NPU_VERSION"] in WHEEL_RELEASES, ARGS["TORCH_NPU_VERSION"]
    assert PTA_RELEASES[release][1] == ARGS["CANN_VERSION"], (release, PTA_RELEASES[release])
    published = {r["version"] for r in json.loads((DATA / "torch_npu_facts.json").read_text())["published_cp311_x86_64"]}
    assert ARGS["TORCH_NPU_VERSION"] in published
    assert ARGS["TORCH_NPU_VERSION"].split(".post")[0] == ARGS["TORCH_VERSION"]  # torch_npu X.Y needs torch X.Y


def test_sgl_kernel_npu_tag_has_every_mapped_kernel():
    tag = ARGS["SGL_KERNEL_NPU_VERSION"]
    facts = json.loads((DATA / "npu_kda_facts.json").read_text())
    assert f"tag {tag}" in facts["sources"]["sgl_kernel_npu"]  # the KDA facts describe the tag the image builds
    assert re.fullmatch(r"\d{4}\.\d{2}\.\d{2}(\.rc\d+)?", tag), tag  # a release tag, not a branch
    for mapping in kda_ops.MAPPINGS.values():
        assert kda_ops._version_key(tag) >= kda_ops._version_key(mapping.since), (mapping.op, mapping.since, tag)


def test_sgl_kernel_npu_target_is_the_base_images_chip():
    target, chip = ARGS["SGL_KERNEL_NPU_SOC"], ARGS["CANN_CHIP"]
    socs = json.loads((DATA / "torch_npu_facts.json").read_text())["soc_names"]
    assert target in socs, f"{target} is in no torch_npu wheel's SoC table"
    # the pinned torch_npu must know the chip by name (torch_npu 2.12.0's table has no Ascend950PR_* / DT_* names)
    for name in (target, "Ascend950DT_9591"):
        assert ARGS["TORCH_NPU_VERSION"] in socs[name], (name, ARGS["TORCH_NPU_VERSION"], socs[name])
    assert "2.12.0" not in socs[target]
    assert soc_of(target).startswith("950") and chip == "950", (target, chip)
    # the A3 alternative docs/ascend.md names is an A3 SoC of the same table
    assert soc_of("Ascend910_9382") == "A3" and "Ascend910_9382" in socs
    assert "Ascend910_9382 for A3" in (ROOT / "docs/ascend.md").read_text()
