#!/usr/bin/env bash
# GRPO on GLM-5.3-Flash (zai-org/GLM-5.3-Flash, glm5_next: 313.8B parameters, 17.4B active; KDA + DSA
# hybrid with mHC, 288 experts, MTP and a vision tower: scripts/models/glm5.3-flash.sh), launched through Ray. One script for every accelerator: parallel sizes and memory settings come from
# scripts/profiles/<accelerator>.sh, picked by `python -m slime.accelerator --name`; the device
# environment comes from `python -m slime.accelerator --env`.
#
#   bash scripts/run-glm5.3-flash-300B.sh --dry-run   # resolved command, placement, per-device memory plan
#   bash scripts/run-glm5.3-flash-300B.sh             # on the head node: start Ray, submit the job
#   bash scripts/run-glm5.3-flash-300B.sh --worker    # on every other node: join the head's Ray cluster
#
# Environment: MASTER_ADDR (head IP), HF_CHECKPOINT, PROMPT_DATA, SAVE_DIR, OUTPUT_DIR, PYTHON (default: the
# project's .venv, else python3);
# SLIME_PROFILE=<name> forces a profile (e.g. to --dry-run another cluster's plan on a laptop); any profile
# variable (TP, EP, NUM_NODES, MAX_TOKENS_PER_GPU, ...) can be overridden. See docs/ascend.md.
set -euo pipefail

MODE=run
for arg in "$@"; do
  case "$arg" in
    --dry-run) MODE=dry-run ;;
    --worker) MODE=worker ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "run-glm5.3-flash-300B.sh: unknown argument '$arg'; use --dry-run, --worker or --help" >&2; exit 2 ;;
  esac
done

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
cd "$ROOT"
# the project's venv (scripts/setup-venv.sh; SLIME_VENV) unless PYTHON names another interpreter
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "${SLIME_VENV:-$ROOT/.venv}/bin/python" ] && PYTHON="${SLIME_VENV:-$ROOT/.venv}/bin/python"
fi
die() { echo "run-glm5.3-flash-300B.sh: $*" >&2; exit 2; }

# --- accelerator -> profile -------------------------------------------------------------------
# First line: the detected accelerator's name; then the device environment its workers need.
ACC_INFO=$("$PYTHON" -m slime.accelerator --name --env) || die "accelerator detection failed (see above)"
DETECTED=$(head -n 1 <<<"$ACC_INFO")
mapfile -t DEVICE_ENV < <(tail -n +2 <<<"$ACC_INFO")
ACCELERATOR=${SLIME_PROFILE:-$DETECTED}
PROFILE_FILE="$SCRIPT_DIR/profiles/$ACCELERATOR.sh"
[ -f "$PROFILE_FILE" ] || die "no profile for accelerator '$ACCELERATOR' ($PROFILE_FILE): this run needs an accelerator cluster with a profile in scripts/profiles/; SLIME_PROFILE=<profile name> picks one for --dry-run"
# shellcheck disable=SC1090  # profile chosen at run time
source "$PROFILE_FILE"
# shellcheck disable=SC1091
source "$SCRIPT_DIR/models/glm5.3-flash.sh"

MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/GLM-5.3-Flash}
PROMPT_DATA=${PROMPT_DATA:-/root/data/dapo-math-17k.jsonl}
SAVE_DIR=${SAVE_DIR:-/root/ckpt/glm5.3-flash-300B-grpo}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/glm5.3-flash-300B-grpo}

if [ "$MODE" = worker ]; then
  # This node's host checks (Ascend: driver / CANN versions and device links), as the head checks its own before
  # Ray; one line and exit 2 on a problem, nothing to check on other accelerators.
  "$PYTHON" -m slime.accelerator --check-host || exit 2
  exec ray start --address="$MASTER_ADDR:$RAY_PORT" --disable-usage-stats --block $RAY_START_ARGS
fi

# --- arguments (train.py flag names) ------------------------------------------------------------
WORLD=$((NUM_NODES * GPUS_PER_NODE))
if [ "$COLOCATE" = 1 ]; then
  ROLLOUT_GPUS=$WORLD
  CLUSTER_ARGS=(--colocate --offload-train --offload-rollout)
else
  ROLLOUT_GPUS=$((ROLLOUT_NUM_NODES * GPUS_PER_NODE))
  [ "$ROLLOUT_GPUS" -gt 0 ] || die "COLOCATE=0 needs ROLLOUT_NUM_NODES > 0 (nodes for the rollout engines)"
  CLUSTER_ARGS=()
fi
CLUSTER_ARGS+=(
   --actor-num-nodes "$NUM_NODES"
   --actor-num-gpus-per-node "$GPUS_PER_NODE"
   --rollout-num-gpus "$ROLLOUT_GPUS"
)

CKPT_ARGS=(
   --hf-checkpoint "$HF_CHECKPOINT"
   --load "$SAVE_DIR"
   --save "$SAVE_DIR"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "$PROMPT_DATA"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rm-type math
   --num-rollout 3000
   --rollout-batch-size 64
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1.0
   --global-batch-size 512
)

PERF_ARGS=(
   --tensor-model-parallel-size "$TP"
   --pipeline-model-parallel-size "$PP"
   --expert-model-parallel-size "$EP"
   --use-dynamic-batch-size
   --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU"
   --log-probs-chunk-size 1024
   --bf16
)
[ "$TP" -gt 1 ] && PERF_ARGS+=(--sequence-parallel)
PERF_ARGS+=(--use-distributed-optimizer)
PLAN_MEMORY_ARGS=(--recompute "$RECOMPUTE")
if [ "$RECOMPUTE" = full ]; then
  PERF_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
if [ "$OPTIMIZER_CPU_OFFLOAD" = 1 ]; then
  PERF_ARGS+=(--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer)
  PLAN_MEMORY_ARGS+=(--optimizer-cpu-offload)
fi
PERF_ARGS+=(--expert-tensor-parallel-size "$ETP" --context-parallel-size "$CP")  # train.py accepts expert-TP 1

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis
)

OPTIMIZER_ARGS=(
   --lr 1e-6
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   --clip-grad 1.0
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine "$ROLLOUT_GPUS_PER_ENGINE"
   --sglang-mem-fraction-static "$SGLANG_MEM_FRACTION_STATIC"
)

WEIGHT_SYNC_ARGS=(
   --update-weight-mode "$UPDATE_WEIGHT_MODE"
   --update-weight-buffer-size "$UPDATE_WEIGHT_BUFFER_SIZE"
)

TRAIN_ARGS=("${CLUSTER_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}"
            "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${WEIGHT_SYNC_ARGS[@]}" --output-dir "$OUTPUT_DIR")

# --- checks and plan (no device is touched) -----------------------------------------------------
# train.py reads the architecture from the checkpoint; MODEL_ARGS must describe the same model.
if [ -f "$HF_CHECKPOINT/config.json" ]; then PLAN_MODEL=$HF_CHECKPOINT; else PLAN_MODEL=glm5.3-flash; fi
"$PYTHON" -m slime.plan.model_args "$PLAN_MODEL" -- "${MODEL_ARGS[@]}" >/dev/null

PLAN_ARGS=(--model "$PLAN_MODEL" --device "$PLAN_DEVICE" --nodes "$NUM_NODES" --devices-per-node "$GPUS_PER_NODE"
           --tp "$TP" --pp "$PP" --ep "$EP" --cp "$CP" --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU" "${PLAN_MEMORY_ARGS[@]}"
           --rollout-batch-size 64 --n-samples-per-prompt 8 --rollout-max-response-len 8192 --global-batch-size 512
           --rollout-num-gpus-per-engine "$ROLLOUT_GPUS_PER_ENGINE" --rollout-num-gpus "$ROLLOUT_GPUS"
           --sglang-mem-fraction-static "$SGLANG_MEM_FRACTION_STATIC"
           --update-weight-buffer-size "$UPDATE_WEIGHT_BUFFER_SIZE" --etp "$ETP"
           --no-mtp)  # as train.py runs: no MTP training; distributed optimizer (the default of both)
[ "$COLOCATE" = 1 ] || PLAN_ARGS+=(--no-colocate --no-offload)

# Device environment for every Ray worker (from the accelerator, read above).
RUNTIME_ENV_JSON=$("$PYTHON" -c 'import json, sys
env = dict(kv.split("=", 1) for kv in sys.argv[2:] if "=" in kv)
env["PYTHONPATH"] = ":".join(p for p in (sys.argv[1], env.get("PYTHONPATH")) if p)
print(json.dumps({"env_vars": env}))' "$ROOT" "${DEVICE_ENV[@]}")

TOTAL_NODES=$((NUM_NODES + (COLOCATE == 1 ? 0 : ROLLOUT_NUM_NODES)))
JOB=(ray job submit --address="http://127.0.0.1:$RAY_DASHBOARD_PORT" --runtime-env-json="$RUNTIME_ENV_JSON"
     -- "$PYTHON" train.py "${TRAIN_ARGS[@]}")

if [ "$MODE" = dry-run ]; then
  echo "accelerator: $ACCELERATOR (detected: $DETECTED; profile $PROFILE_FILE, planner device $PLAN_DEVICE)"
  echo "model: $PLAN_MODEL; MODEL_ARGS match it"
  "$PYTHON" -c 'import sys; from slime.plan import ModelShape; m = ModelShape.from_config(sys.argv[1])
print(f"parameters: {m.hf_param_count() / 1e9:.1f}B total, {m.active_param_count(True) / 1e9:.1f}B active per token; {m.describe()}")' "$PLAN_MODEL"
  echo "devices: $((TOTAL_NODES * GPUS_PER_NODE)) planned ($TOTAL_NODES node(s) x $GPUS_PER_NODE)"
  echo "placement: $TOTAL_NODES node(s) x $GPUS_PER_NODE devices; trainer $NUM_NODES node(s) = $WORLD devices" \
       "(tp=$TP pp=$PP ep=$EP cp=$CP etp=$ETP dp=$((WORLD / (TP * PP * CP))));" \
       "rollout $((ROLLOUT_GPUS / ROLLOUT_GPUS_PER_ENGINE)) engine(s) x $ROLLOUT_GPUS_PER_ENGINE devices" \
       "$([ "$COLOCATE" = 1 ] && echo "colocated on the trainer's devices" || echo "on $ROLLOUT_NUM_NODES separate node(s)")"
  echo "device env (from the detected $DETECTED accelerator): ${DEVICE_ENV[*]:-(none)}"
  "$PYTHON" -m slime.plan "${PLAN_ARGS[@]}" --format short || true
  echo "full plan: $PYTHON -m slime.plan ${PLAN_ARGS[*]}"
  # train.py's own dry run of this command: every flag parsed and validated against config.json, and a
  # "would fail at start-up" line for anything the run would stop at (the registry's config.json stands in
  # for a checkpoint that is not on this machine).
  DRY_ARGS=("${TRAIN_ARGS[@]}")
  if [ ! -f "$HF_CHECKPOINT/config.json" ]; then
    DRY_HF=$(mktemp -d)
    trap 'rm -rf "$DRY_HF"' EXIT
    cp "$SCRIPT_DIR/models/configs/glm5.3-flash.json" "$DRY_HF/config.json"
    for i in "${!DRY_ARGS[@]}"; do
      [ "${DRY_ARGS[$i]}" = --hf-checkpoint ] && DRY_ARGS[$((i + 1))]=$DRY_HF
    done
    echo "train.py --dry-run with scripts/models/configs/glm5.3-flash.json as $HF_CHECKPOINT/config.json:"
  fi
  "$PYTHON" train.py "${DRY_ARGS[@]}" --dry-run --dry-run-device "$PLAN_DEVICE" | sed 's/^/  /'
  echo "head:      ray start --head --node-ip-address $MASTER_ADDR --port $RAY_PORT --dashboard-host 127.0.0.1 --dashboard-port $RAY_DASHBOARD_PORT --disable-usage-stats $RAY_START_ARGS"
  echo "workers:   MASTER_ADDR=$MASTER_ADDR bash scripts/run-glm5.3-flash-300B.sh --worker"
  printf 'command:  '; printf ' %q' "${JOB[@]}"; echo
  exit 0
fi

"$PYTHON" -m slime.plan "${PLAN_ARGS[@]}" --format short || echo "warning: the planner says this layout does not fit; continuing" >&2
for kv in "${DEVICE_ENV[@]}"; do export "${kv?}"; done
ray start --head --node-ip-address "$MASTER_ADDR" --port "$RAY_PORT" --dashboard-host 127.0.0.1 \
  --dashboard-port "$RAY_DASHBOARD_PORT" --disable-usage-stats $RAY_START_ARGS
# Wait for the worker nodes (started with --worker) before placing the job.
for _ in $(seq 1 120); do
  nodes=$("$PYTHON" -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(sum(n["Alive"] for n in ray.nodes()))' 2>/dev/null || echo 0)
  [ "$nodes" -ge "$TOTAL_NODES" ] && break
  echo "waiting for Ray nodes: $nodes/$TOTAL_NODES" >&2
  sleep 10
done
[ "${nodes:-0}" -ge "$TOTAL_NODES" ] || die "only ${nodes:-0} of $TOTAL_NODES Ray nodes joined; start the others with --worker"
exec "${JOB[@]}"
