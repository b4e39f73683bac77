"""Regenerate upstream_train_commands.json: run each of upstream slime's scripts/run-*.sh (git archive of the
commit into a temp dir) with `ray`, `pkill` and `nvidia-smi` (and `pip list`) replaced by stubs; the `ray` stub records the words
after `--` of `ray job submit` (train.py's command line) and, for --sglang-config, the YAML the script wrote.

    python tests/data/capture_upstream_train_commands.py /path/to/THUDM/slime.git COMMIT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAY_STUB = r'''#!/usr/bin/env python3
import json, os, sys
argv = sys.argv[1:]
if argv[:2] == ["job", "submit"]:
    cmd = argv[argv.index("--") + 1:]
    out = {"program": cmd[1], "argv": cmd[2:]}
    if "--sglang-config" in cmd:
        i = cmd.index("--sglang-config")
        out["sglang_config_yaml"] = open(cmd[i + 1]).read()
        cmd[i + 1] = "{SGLANG_CONFIG}"
        out["argv"] = cmd[2:]
    with open(os.environ["CAPTURE"], "w") as f:
        json.dump(out, f)
'''
# run-kimi-k2-Instruct.sh misses the backslash after this line; its intended command line has it
FIXES = {"run-kimi-k2-Instruct.sh": ("--update-weight-buffer-size $(( 4 * 512 * 1024 * 1024))\n",
                                     "--update-weight-buffer-size $(( 4 * 512 * 1024 * 1024)) \\\n")}
ENV = {"BASE_DIR": "/BASE", "BASE_FOLDER": "/BASE", "MASTER_ADDR": "127.0.0.1", "NUM_GPUS": "8", "WANDB_KEY": "", "no_proxy": ""}


def capture(repo: str, commit: str) -> dict:
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(f"git -C {repo} archive {commit} scripts | tar x -C {tmp}", shell=True, check=True)
    # run-qwen2.5-0.5B-reproducibility.sh sources ${SCRIPT_DIR}/scripts/models/ (written to run from the repo root)
    (tmp / "scripts" / "scripts").symlink_to(".")
    stubs = tmp / "bin"
    stubs.mkdir()
    (stubs / "ray").write_text(RAY_STUB)
    for name in ("pkill", "nvidia-smi", "sleep"):
        (stubs / name).write_text("#!/bin/sh\nexit 0\n")
    # run-qwen3-4B-amd.sh reads Megatron's source dir from `pip list` (under pipefail)
    (stubs / "pip").write_text("#!/bin/sh\necho 'megatron-core 0.16.1 /root/Megatron-LM'\n")
    for p in stubs.iterdir():
        p.chmod(0o755)
    out = {}
    for script in sorted((tmp / "scripts").glob("run-*.sh")):
        if script.name in FIXES:
            old, new = FIXES[script.name]
            script.write_text(script.read_text().replace(old, new))
        env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", CAPTURE=str(tmp / "cap.json"), **ENV)
        r = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{script.name} failed: {r.stderr[-2000:]}")
        out[script.name] = json.loads((tmp / "cap.json").read_text())
    return out


if __name__ == "__main__":
    repo, commit = sys.argv[1], sys.argv[2]
    print(json.dumps(capture(repo, commit), indent=1))
