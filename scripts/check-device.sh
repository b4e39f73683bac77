#!/usr/bin/env bash
# Validate a GPU or NPU machine with one command: the accelerator smoke check, then
# benchmarks/device_check.py, which writes one markdown report to $OUT/device-report.md (default
# outputs/device-check/): the device-marked tests, every op forward/backward in bf16 and fp32 against a
# float64 reference (error, time against the reference op), IPC across two processes, a 1-rank group on
# the device's collective backend, the tiny GLM-5 and a GLM-5-shaped model of ~30 GB bf16 weights
# (log-probs against transformers, one training step: tokens/s, MFU, peak memory), and the weight-sync
# benchmark's colocated mode against the device's copy bandwidth. Budget: ~8 minutes on one H200.
#
#   bash scripts/check-device.sh              # run everything, exit 1 if any check fails
#   bash scripts/check-device.sh --dry-run    # print the steps and the plan; checks imports and the op table
#   bash scripts/check-device.sh -- --sections ops,model --big-gb 10   # arguments for device_check.py
#
# Needs a CUDA or Ascend device (on a CPU-only machine it stops with the reason; --allow-cpu runs the
# same checks on the CPU at tiny sizes). PYTHON picks the interpreter (default python3). A machine without
# a package registry gets megatron-core from wheels/ (pip download megatron-core==0.16.1 --no-deps
# --only-binary=:all: --python-version 3.12 -d wheels/), installed with --no-deps into .device-deps/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python3}
DRY=0
ALLOW_CPU=0
CHECK_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --allow-cpu) ALLOW_CPU=1 ;;
    --) shift; CHECK_EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "check-device.sh: unknown argument '$1'; use --dry-run, --allow-cpu, -- DEVICE_CHECK_ARGS" >&2; exit 2 ;;
  esac
  shift
done

# Packages the machine lacks (no registry there): carried wheels, installed beside the repo, never over torch.
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null && ls wheels/*.whl >/dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then
    echo "  would install: $(ls wheels/*.whl | xargs -n1 basename | tr '\n' ' ')(--no-deps into .device-deps/)"
  else
    "$PYTHON" -m pip install -q --no-deps --no-index --target .device-deps wheels/*.whl
  fi
fi
[ -d .device-deps ] && export PYTHONPATH="$ROOT/.device-deps${PYTHONPATH:+:$PYTHONPATH}"

ACC=$("$PYTHON" -m slime.accelerator --name) || { echo "check-device.sh: accelerator detection failed (see above)" >&2; exit 2; }
if [ "$ACC" = cpu ] && [ "$ALLOW_CPU" = 0 ] && [ "$DRY" = 0 ]; then
  echo "check-device.sh: no GPU or NPU in this process (accelerator: cpu); run \`$PYTHON -m slime.accelerator\` with SLIME_ACCELERATOR=cuda or npu to see why, or pass --allow-cpu" >&2
  exit 2
fi

# conftest.py adds the real NPU to the accelerator parametrization only when asked (torch_npu may
# import without a usable device); the GPU is added whenever present.
export SLIME_TEST_NPU=1 SLIME_TEST_REAL_DEVICES=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
EXTRA_QUOTED=$([ ${#CHECK_EXTRA[@]} -gt 0 ] && printf ' %q' "${CHECK_EXTRA[@]}" || true)
REPORT_DIR=${OUT:-$ROOT/outputs/device-check}
CPU_FLAG=$([ "$ALLOW_CPU" = 1 ] && echo " --allow-cpu" || true)
STEPS=(
  "smoke|$PYTHON -m slime.accelerator"
  "device report|$PYTHON benchmarks/device_check.py --out $(printf '%q' "$REPORT_DIR")$CPU_FLAG$EXTRA_QUOTED"
)

echo "check-device: accelerator $ACC"
if [ "$DRY" = 1 ]; then
  for step in "${STEPS[@]}"; do echo "  ${step%%|*}: ${step#*|}"; done
  echo "plan (device_check.py --dry-run):"
  "$PYTHON" benchmarks/device_check.py --out "$REPORT_DIR" --dry-run ${CHECK_EXTRA[@]+"${CHECK_EXTRA[@]}"} 2>/dev/null | sed 's/^/  /'
  exit "${PIPESTATUS[0]}"
fi

FAILED=()
for step in "${STEPS[@]}"; do
  name=${step%%|*}
  cmd=${step#*|}
  echo "=== $name: $cmd"
  set +e
  bash -c "$cmd"
  rc=$?
  set -e
  [ "$rc" -ne 0 ] && FAILED+=("$name")
done

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "check-device: FAILED on $ACC: ${FAILED[*]}" >&2
  exit 1
fi
echo "check-device: all steps passed on $ACC; report: $REPORT_DIR/device-report.md"
