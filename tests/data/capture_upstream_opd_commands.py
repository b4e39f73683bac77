"""Regenerate upstream_opd_commands.json: run upstream slime's two on-policy-distillation example scripts
(examples/on_policy_distillation/run-qwen3-8B-opd*.sh, git archive of the commit into a temp dir) with `ray`,
`pkill`, `nvidia-smi`, `sleep`, `curl` and `python3` replaced by stubs (the sglang one starts a teacher server
with python3 and waits for it with curl); the `ray` stub records the words after `--` of `ray job submit`.
The scripts source /root/slime/scripts/models/qwen3-8B.sh; the archive's copy is sourced instead.

    python tests/data/capture_upstream_opd_commands.py /path/to/THUDM/slime.git COMMIT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RAY_STUB = r'''#!/usr/bin/python3
import json, os, sys
argv = sys.argv[1:]
if argv[:2] == ["job", "submit"]:
    cmd = argv[argv.index("--") + 1:]
    with open(os.environ["CAPTURE"], "w") as f:
        json.dump({"program": cmd[1], "argv": cmd[2:]}, f)
'''
SCRIPTS = ("run-qwen3-8B-opd.sh", "run-qwen3-8B-opd-megatron.sh")


def capture(repo: str, commit: str) -> dict:
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(f"git -C {repo} archive {commit} scripts examples/on_policy_distillation | tar x -C {tmp}",
                   shell=True, check=True)
    stubs = tmp / "bin"
    stubs.mkdir()
    (stubs / "ray").write_text(RAY_STUB)
    for name in ("pkill", "nvidia-smi", "sleep", "curl", "python3"):
        (stubs / name).write_text("#!/bin/sh\nexit 0\n")
    for p in stubs.iterdir():
        p.chmod(0o755)
    out = {}
    for name in SCRIPTS:
        script = tmp / "examples" / "on_policy_distillation" / name
        script.write_text(script.read_text().replace("/root/slime/scripts/models/", f"{tmp}/scripts/models/"))
        env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", CAPTURE=str(tmp / "cap.json"), WANDB_KEY="")
        r = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{name} failed: {r.stderr[-2000:]}")
        out[name] = json.loads((tmp / "cap.json").read_text())
    return out


if __name__ == "__main__":
    repo, commit = sys.argv[1], sys.argv[2]
    print(json.dumps({"repository": "THUDM/slime", "commit": commit, "scripts": capture(repo, commit)}, indent=1))
