#!/usr/bin/env bash
# GLM-4.7-Flash (30B total, ~3B active; HF model_type glm4_moe_lite) GRPO on ONE node of 8 GPUs (H100 80 GB or
# H200 141 GB): trainer and rollout engine share the 8 GPUs (--colocate), TP 2 x EP 8, the optimizer state in
# host memory (~45 GB per GPU, ~360 GB for the node). docs/gpu.md explains the layout and how to change it.
#
#   bash scripts/run-glm4.7-flash-8xgpu.sh --dry-run    # anywhere (a laptop too): flags vs config.json + memory plan
#   bash scripts/run-glm4.7-flash-8xgpu.sh              # on the GPU node: starts a local Ray and trains
#
# Environment: HF_CHECKPOINT (default /root/GLM-4.7-Flash), PROMPT_DATA (a jsonl with "prompt" / "label"),
# SAVE_DIR, OUTPUT_DIR, PLAN_DEVICE (h100 | h200: the dry run's memory plan), PYTHON (default: the project's
# .venv, else python3). Extra arguments go to train.py (e.g. --num-rollout 10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY=()
PASS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=(--dry-run --dry-run-device "${PLAN_DEVICE:-h100}") ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) PASS+=("$arg") ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "${SLIME_VENV:-$ROOT/.venv}/bin/python" ] && PYTHON="${SLIME_VENV:-$ROOT/.venv}/bin/python"
fi
# shellcheck source=models/glm4.7-flash.sh
source "$ROOT/scripts/models/glm4.7-flash.sh"
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/GLM-4.7-Flash}
SAVE_DIR=${SAVE_DIR:-/root/ckpt/glm4.7-flash-grpo}

CKPT_ARGS=(--hf-checkpoint "$HF_CHECKPOINT" --load "$SAVE_DIR" --save "$SAVE_DIR" --save-interval 20)
ROLLOUT_ARGS=(--prompt-data "${PROMPT_DATA:-/root/data/dapo-math-17k.jsonl}" --input-key prompt --label-key label
  --apply-chat-template --rm-type math --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 1.0 --global-batch-size 256)
# 20 attention heads and 64 experts: TP 1, 2 or 4 and EP 1, 2, 4 or 8 divide them (train.py names the valid
# sizes if not). TP 2 x EP 8 on 8 GPUs: DP 4 for the dense part, each GPU holds 8 of the 64 experts.
PERF_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu 16384)
GRPO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
  --eps-clip 0.2 --eps-clip-high 0.28)
# Adam's fp32 state of the experts is not sharded (EP 8 on 8 GPUs leaves one expert-data-parallel rank), ~45 GB
# per GPU: it lives in host memory, which leaves an H100 room for the rollout's KV cache
OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9
  --adam-beta2 0.98 --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7)

exec "$PYTHON" train.py "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" \
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" --bf16 \
  --output-dir "${OUTPUT_DIR:-outputs/glm4.7-flash-grpo}" ${DRY[@]+"${DRY[@]}"} ${PASS[@]+"${PASS[@]}"}
