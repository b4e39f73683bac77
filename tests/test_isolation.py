"""The isolation rule: device-specific names appear only inside slime/accelerator/."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = [
    r"torch\.cuda", r"\.cuda\(", r"torch_npu", r"torch\.npu", r"[\"']nccl[\"']", r"[\"']hccl[\"']",
    r"CUDA_VISIBLE_DEVICES", r"ASCEND_RT_VISIBLE_DEVICES",
]
# Branches on which device this is: ask a behaviour predicate or a Capabilities field instead
# (acc.is_synchronized_device(), acc.memory_is_host(), acc.capabilities.ipc, ...).
DEVICE_BRANCHES = [
    r"device_type\s*(?:[!=]=|(?:not\s+)?in\b)",  # acc.device_type == "cpu", t.device_type in (...)
    r"\.type\s*[!=]=\s*[\"'](?:cpu|cuda|npu)[\"']",  # t.device.type == "cpu"
    r"\.name\s*[!=]=\s*[\"'](?:cpu|cuda|npu)[\"']",  # acc.name == "npu"
    r"\bNull(?:Stream|Event)\b",  # isinstance(..., NullStream) spelled "has no streams" as a type test
]
PATTERN = re.compile("|".join(FORBIDDEN + DEVICE_BRANCHES))
ALLOWED_DIR = os.path.join(REPO, "slime", "accelerator")


def _python_files(root: str):
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def offending_lines(roots=("slime", "slime_plugins")) -> list[str]:
    hits = []
    for r in roots:
        for path in _python_files(os.path.join(REPO, r)):
            if path.startswith(ALLOWED_DIR + os.sep):
                continue
            with open(path, encoding="utf-8") as fh:
                for i, line in enumerate(fh, 1):
                    if PATTERN.search(line):
                        hits.append(f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}")
    return hits


def test_no_device_names_outside_accelerator():
    hits = offending_lines()
    assert not hits, "device-specific code outside slime/accelerator/ (use get_accelerator()):\n" + "\n".join(hits)


def test_detector_catches_a_violation(tmp_path, monkeypatch):
    pkg = tmp_path / "slime" / "backends"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("import torch\nx = torch.cuda.current_device()\nb = 'nccl'\n")
    # one line per device-type branch the rule must catch (the forms the code base had before)
    branches = ['if acc.device_type == "cpu":', 'k = "e" if acc.device_type != "cpu" else "s"',
                'dt = torch.float32 if self.device.type == "cpu" else "auto"', 'if t.device.type != "cpu":',
                'isinstance(acc.current_stream(), NullStream)', 'if acc.name == "npu":']
    (pkg / "branches.py").write_text("\n".join(branches) + "\nok = acc.is_synchronized_device()\n")
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path), raising=False)
    global REPO, ALLOWED_DIR
    old = REPO, ALLOWED_DIR
    REPO, ALLOWED_DIR = str(tmp_path), str(tmp_path / "slime" / "accelerator")
    try:
        hits = offending_lines()
    finally:
        REPO, ALLOWED_DIR = old
    bad = [h for h in hits if "bad.py" in h]
    assert len(bad) == 2 and "bad.py:2" in bad[0] and "bad.py:3" in bad[1]
    caught = sorted(int(h.split(":")[1]) for h in hits if "branches.py" in h)
    assert caught == list(range(1, len(branches) + 1))  # every branch, not the predicate call
