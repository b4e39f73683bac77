#!/usr/bin/env bash
# Create (or reuse) the project's CPU virtual environment at $SLIME_VENV (default .venv).
# Idempotent: re-running only reinstalls when pyproject.toml or the constraints changed.
# The CPU torch wheel is installed FIRST and pinned by constraints/cpu.txt, so no other
# package can pull a CUDA build of torch. Never installs torch-npu (it breaks `import torch`
# on a machine without CANN).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLIME_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/constraints/cpu.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.slime-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "torch==$(grep -E '^torch==' "$CONSTRAINTS" | cut -d= -f3)"
"${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[test]"
echo "$WANT" > "$STAMP"
