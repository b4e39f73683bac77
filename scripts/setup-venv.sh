#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at $SLIME_VENV (default .venv) for this machine:
# an NVIDIA driver (nvidia-smi) -> constraints/cuda.txt, an Ascend driver / CANN set_env.sh -> npu.txt,
# neither -> cpu.txt (scripts/lib/machine.sh; SLIME_MACHINE=cpu|cuda|npu overrides). Says in one line what it chose.
# A torch built for an accelerator that is already there (a CUDA or CANN image, SLIME_VENV pointing at it) is
# never replaced: that environment is used as is. --use-existing: use $SLIME_VENV as is, whatever its torch.
# --print-plan: print the choice and exit (installs nothing).
# Idempotent: re-running only reinstalls when pyproject.toml, the constraints or the machine changed.
# torch is installed FIRST and pinned by the constraints, so no other package can swap its build. The CPU set
# never installs torch-npu (it breaks `import torch` on a machine without CANN). Prints each step, what it
# installs and how long it took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLIME_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
USE_EXISTING=0
PRINT_PLAN=0
for arg in "$@"; do
  case "$arg" in
    --use-existing) USE_EXISTING=1 ;;
    --print-plan) PRINT_PLAN=1 ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup-venv.sh: unknown argument $arg (use --use-existing, --print-plan)" >&2; exit 2 ;;
  esac
done
# shellcheck source=lib/machine.sh
source "$ROOT/scripts/lib/machine.sh"
MACHINE="$(slime_detect_machine)" || exit 2
CONSTRAINTS="$(slime_constraints_for "$MACHINE")"
EXISTING="$(slime_torch_build "$VENV/bin/python")"  # "KIND VERSION" or empty
case "$MACHINE" in
  cuda) WHY="nvidia-smi found" ;;
  npu) WHY="Ascend CANN found${SLIME_MACHINE:+ (SLIME_MACHINE)}" ;;
  *) WHY="no nvidia-smi, no Ascend CANN" ;;
esac
[ -n "${SLIME_MACHINE:-}" ] && WHY="SLIME_MACHINE=$SLIME_MACHINE"
if [ "$USE_EXISTING" = 1 ] || [[ "$EXISTING" == cuda* || "$EXISTING" == npu* ]]; then
  if [ -z "$EXISTING" ]; then
    echo "setup: --use-existing: $VENV/bin/python has no torch; install your torch there first or drop --use-existing" >&2
    exit 2
  fi
  echo "setup: $MACHINE machine ($WHY); $VENV already has torch ${EXISTING#* } (${EXISTING%% *} build): using it as is, installing nothing"
  [ "$PRINT_PLAN" = 1 ] && exit 0
  missing=$("$VENV/bin/python" - <<'PY'
import importlib.util
print(" ".join(n for n in ("megatron.core", "ray", "transformers", "safetensors") if importlib.util.find_spec(n) is None))
PY
  )
  if [ -n "$missing" ]; then
    echo "setup: $VENV lacks $missing; add them without touching its torch: $VENV/bin/python -m pip install" \
         "-c $CONSTRAINTS megatron-core ray transformers safetensors 'torch==${EXISTING#* }'" >&2
    exit 1
  fi
  exit 0
fi
pin() { grep -E "^$1==" "$CONSTRAINTS" | cut -d= -f3; }
echo "setup: $MACHINE machine ($WHY): constraints/$MACHINE.txt, torch $(pin torch)$([ "$MACHINE" = npu ] && echo " + torch-npu $(pin torch-npu)") into $VENV"
[ "$PRINT_PLAN" = 1 ] && exit 0

STAMP="$VENV/.slime-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
START=$SECONDS
step() { echo "[setup $((SECONDS - START))s] $*"; }
step "installing into $VENV: about 2.1 GB on CPU (more with a CUDA torch), typically 2-4 minutes on a fresh machine (a status line shows what pip is doing)"
# A line every 8 s while the install runs (minutes on a fresh machine; pip -q itself is silent for long stretches).
heartbeat() { while sleep 8 >/dev/null 2>&1; do echo "  [setup $((SECONDS - START))s] still installing ..."; done; }
heartbeat &
HEARTBEAT=$!
trap 'kill "$HEARTBEAT" 2>/dev/null || true' EXIT
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
case "$MACHINE" in
  cuda)
    step "1/2 torch $(pin torch) (PyPI's CUDA build, several GB with its nvidia-* wheels)"
    "${PIP[@]}" install -c "$CONSTRAINTS" "torch==$(pin torch)"
    step "2/2 slime (editable) with SGLang $(pin sglang), megatron-core $(pin megatron-core), ray $(pin ray) (the cuda extra)"
    pip_with_progress install -c "$CONSTRAINTS" -e "$ROOT[test,cuda]" ;;
  npu)
    step "1/2 torch $(pin torch) (CPU build, as torch-npu requires) + torch-npu $(pin torch-npu)"
    "${PIP[@]}" install -c "$CONSTRAINTS" "torch==$(pin torch)" "torch-npu==$(pin torch-npu)" \
      --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    step "2/2 slime (editable) with ray $(pin ray), megatron-core $(pin megatron-core), transformers $(pin transformers)"
    pip_with_progress install -c "$CONSTRAINTS" -e "$ROOT[test]" ;;
  *)
    step "1/2 torch $(pin torch) (CPU wheel, ~200 MB download, ~40 s)"
    "${PIP[@]}" install "torch==$(pin torch)"
    step "2/2 slime (editable) with ray $(pin ray), megatron-core $(pin megatron-core), transformers $(pin transformers), pytest and their dependencies (~1-2 min)"
    pip_with_progress install -c "$CONSTRAINTS" -e "$ROOT[test]" ;;
esac
# The test-only sglang-test extra (SGLang's own classes for the wire-format tests), WITHOUT dependencies:
# SGLang's dependencies pin a CUDA torch, which must never replace the CPU build installed above.
mapfile -t SGLANG_TEST < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r'^sglang-test = \[(.*?)\]', text, re.M | re.S)
print("\n".join(re.findall(r'"([^"]+)"', m.group(1))) if m else "")
PY
)
if [ "$MACHINE" = cpu ] && [ "${#SGLANG_TEST[@]}" -gt 0 ] && [ -n "${SGLANG_TEST[0]}" ]; then
  "${PIP[@]}" install --no-deps -c "$CONSTRAINTS" "${SGLANG_TEST[@]}"
fi
echo "$WANT" > "$STAMP"
kill "$HEARTBEAT" 2>/dev/null || true
step "done: $VENV"
