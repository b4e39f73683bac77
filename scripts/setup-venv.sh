#!/usr/bin/env bash
# Create (or reuse) the project's CPU virtual environment at $SLIME_VENV (default .venv).
# Idempotent: re-running only reinstalls when pyproject.toml or the constraints changed.
# The CPU torch wheel is installed FIRST and pinned by constraints/cpu.txt, so no other
# package can pull a CUDA build of torch. Never installs torch-npu (it breaks `import torch`
# on a machine without CANN). Prints each step, what it installs and how long it took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLIME_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/constraints/cpu.txt"

STAMP="$VENV/.slime-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
pin() { grep -E "^$1==" "$CONSTRAINTS" | cut -d= -f3; }
START=$SECONDS
step() { echo "[setup $((SECONDS - START))s] $*"; }
step "installing into $VENV: about 1.4 GB, typically 2-4 minutes on a fresh machine (pip's own output is quiet)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
step "1/2 torch $(pin torch) (CPU wheel, ~200 MB download, ~40 s)"
"${PIP[@]}" install "torch==$(pin torch)"
step "2/2 slime (editable) with ray $(pin ray), megatron-core $(pin megatron-core), transformers $(pin transformers), pytest and their dependencies (~1-2 min)"
"${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[test]"
# The test-only sglang-test extra (SGLang's own classes for the wire-format tests), WITHOUT dependencies:
# SGLang's dependencies pin a CUDA torch, which must never replace the CPU build installed above.
mapfile -t SGLANG_TEST < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r'^sglang-test = \[(.*?)\]', text, re.M | re.S)
print("\n".join(re.findall(r'"([^"]+)"', m.group(1))) if m else "")
PY
)
if [ "${#SGLANG_TEST[@]}" -gt 0 ] && [ -n "${SGLANG_TEST[0]}" ]; then
  "${PIP[@]}" install --no-deps -c "$CONSTRAINTS" "${SGLANG_TEST[@]}"
fi
echo "$WANT" > "$STAMP"
step "done: $VENV"
