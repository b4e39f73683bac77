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
step "installing into $VENV: about 1.4 GB, typically 2-4 minutes on a fresh machine (a status line shows what pip is doing)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
LOG="$VENV/.slime-install.log"
# pip's lines become one moving status line on a terminal (a line every 15 s in a log); all of them go to
# $LOG, whose tail is shown if pip fails.
progress() {
  local n=0 last=$SECONDS line
  while IFS= read -r line; do
    case "$line" in Collecting*|Requirement\ already*) n=$((n + 1)) ;; esac
    if [ -t 1 ]; then
      printf '\r  [setup %ss] %d packages resolved: %-60.60s' "$((SECONDS - START))" "$n" "$line"
    elif [ $((SECONDS - last)) -ge 15 ]; then
      echo "  [setup $((SECONDS - START))s] $n packages resolved: ${line:0:60}"
      last=$SECONDS
    fi
  done
  if [ -t 1 ]; then printf '\r%100s\r' ''; fi
}
pip_with_progress() {
  if ! "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | tee "$LOG" | progress; then
    echo "pip install failed; the last lines of $LOG:" >&2
    tail -n 20 "$LOG" >&2
    exit 1
  fi
}
step "1/2 torch $(pin torch) (CPU wheel, ~200 MB download, ~40 s)"
"${PIP[@]}" install "torch==$(pin torch)"
step "2/2 slime (editable) with ray $(pin ray), megatron-core $(pin megatron-core), transformers $(pin transformers), pytest and their dependencies (~1-2 min)"
pip_with_progress install -c "$CONSTRAINTS" -e "$ROOT[test]"
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
