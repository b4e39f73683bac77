#!/usr/bin/env bash
# Validate a GPU or NPU machine with one command: the accelerator smoke check, every device-marked
# test (`pytest -m device`: the accelerator-parametrized tests on the real device), and the op
# benchmark (benchmarks/ops.py) on whatever accelerator is present.
#
#   bash scripts/check-device.sh              # run everything, exit 1 if any step fails
#   bash scripts/check-device.sh --dry-run    # print the steps only
#   bash scripts/check-device.sh -- -k attention   # extra arguments for pytest
#
# Needs a CUDA or Ascend device (on a CPU-only machine it stops with the reason; --allow-cpu runs the
# steps anyway, which selects no device tests). PYTHON picks the interpreter (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python3}
DRY=0
ALLOW_CPU=0
PYTEST_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --allow-cpu) ALLOW_CPU=1 ;;
    --) shift; PYTEST_EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "check-device.sh: unknown argument '$1'; use --dry-run, --allow-cpu, -- PYTEST_ARGS" >&2; exit 2 ;;
  esac
  shift
done

ACC=$("$PYTHON" -m slime.accelerator --name) || { echo "check-device.sh: accelerator detection failed (see above)" >&2; exit 2; }
if [ "$ACC" = cpu ] && [ "$ALLOW_CPU" = 0 ] && [ "$DRY" = 0 ]; then
  echo "check-device.sh: no GPU or NPU in this process (accelerator: cpu); run \`$PYTHON -m slime.accelerator\` with SLIME_ACCELERATOR=cuda or npu to see why, or pass --allow-cpu" >&2
  exit 2
fi

# conftest.py adds the real NPU to the accelerator parametrization only when asked (torch_npu may
# import without a usable device); the GPU is added whenever present.
export SLIME_TEST_NPU=1 SLIME_TEST_REAL_DEVICES=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
EXTRA_QUOTED=$([ ${#PYTEST_EXTRA[@]} -gt 0 ] && printf ' %q' "${PYTEST_EXTRA[@]}" || true)
STEPS=(
  "smoke|$PYTHON -m slime.accelerator"
  "device tests|$PYTHON -m pytest -q -m device tests$EXTRA_QUOTED"
  "op benchmark|$PYTHON benchmarks/ops.py"
)

echo "check-device: accelerator $ACC"
if [ "$DRY" = 1 ]; then
  for step in "${STEPS[@]}"; do echo "  ${step%%|*}: ${step#*|}"; done
  exit 0
fi

FAILED=()
for step in "${STEPS[@]}"; do
  name=${step%%|*}
  cmd=${step#*|}
  echo "=== $name: $cmd"
  if [ "$name" = "op benchmark" ] && [ ! -f benchmarks/ops.py ]; then
    echo "benchmarks/ops.py is missing from this checkout" >&2
    FAILED+=("$name"); continue
  fi
  set +e
  bash -c "$cmd"
  rc=$?
  set -e
  # pytest exit 5 = nothing collected: no test ran on the device, which is a failed validation.
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 5 ] && echo "no device-marked test was collected for $ACC" >&2
    FAILED+=("$name")
  fi
done

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "check-device: FAILED on $ACC: ${FAILED[*]}" >&2
  exit 1
fi
echo "check-device: all steps passed on $ACC"
