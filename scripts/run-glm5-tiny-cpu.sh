#!/usr/bin/env bash
# Quick start: GRPO on a tiny GLM-5 (glm_moe_dsa: MLA + DSA + MoE) that learns to copy a short string.
# The checkpoint is random init plus a short supervised warm-up (a few seconds on CPU) that leaves it
# partly competent, the prior RL post-training starts from; GRPO trains on from there
# (docs/training.md, "What the quick start learns"). Trainer (Megatron) and rollout engine are colocated
# under Ray; weights go to the engine through IPC after every step. On a CPU machine (~2 cores, a few
# minutes): the embedded engine and shared-memory IPC. The same script, unchanged, runs on a GPU or NPU
# machine: the accelerator is detected (SLIME_ACCELERATOR overrides), the engine is SGLang where
# installed, and the weight-sync transport is the device's (IPC, or a collective broadcast where the
# device has no IPC).
#
# Environment knobs: RUN_DIR (outputs, default outputs/glm5-tiny), NUM_ROLLOUT (default 60), WARMUP_STEPS
# (supervised steps of the checkpoint, default 600; 0 is the random-init model, which plateaus at ~0.35).
# Extra arguments are passed to train.py (e.g. --num-rollout 10; --eval-interval 2 evaluates greedily on 32
# prompts of another seed before training and every 2 rollouts: eval records in metrics.jsonl and report.png).
# Checkpoints are written in the background (--async-save) while the next rollouts run, and published once written.
# Re-running resumes from RUN_DIR/ckpt (train.py says so); re-run before the first checkpoint (rollout 19),
# the same command restarts from rollout 0 (its unsaved records discarded, said so). A RUN_DIR holding
# another run's metrics is refused (one line): pick a fresh RUN_DIR or pass --overwrite-output.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${SLIME_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
cd "$ROOT"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

RUN_DIR="${RUN_DIR:-$ROOT/outputs/glm5-tiny}"
NUM_ROLLOUT="${NUM_ROLLOUT:-60}"
WARMUP_STEPS="${WARMUP_STEPS:-600}"
ACCELERATOR="$("$PY" -m slime.accelerator --name)"
echo "accelerator: $ACCELERATOR   run dir: $RUN_DIR"
mkdir -p "$RUN_DIR"

# 1. The tiny GLM-5 checkpoint (random init, seed 0, then WARMUP_STEPS supervised steps on the copy task;
#    offline tokenizer) and the synthetic copy task.
[ -f "$RUN_DIR/model/config.json" ] || "$PY" -m slime_plugins.models.glm5.tiny "$RUN_DIR/model" \
  --warmup-steps "$WARMUP_STEPS" --warmup-tasks copy
[ -f "$RUN_DIR/data.jsonl" ] || "$PY" -m slime.rollout.synthetic --out "$RUN_DIR/data.jsonl" --num 4096 --seed 0
[ -f "$RUN_DIR/eval.jsonl" ] || "$PY" -m slime.rollout.synthetic --out "$RUN_DIR/eval.jsonl" --num 32 --seed 1

# 2. GRPO: 8 prompts x 8 samples per rollout, one optimizer step per rollout.
# Only --num-cpus is host-specific: CPU slots Ray may use (ignored by device placement on GPU/NPU).
"$PY" train.py \
  --hf-checkpoint "$RUN_DIR/model" \
  --prompt-data "$RUN_DIR/data.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --rm-type synthetic --rollout-shuffle --rollout-seed 1 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --rollout-num-gpus-per-engine 1 \
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8 \
  --rollout-max-response-len 8 --rollout-temperature 1.0 \
  --global-batch-size 64 --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --lr 4e-4 --weight-decay 0.0 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.98 --seed 1234 \
  --update-weight-mode auto --update-weight-buffer-size $((64 * 1024 * 1024)) \
  --save "$RUN_DIR/ckpt" --load "$RUN_DIR/ckpt" --save-interval 20 --async-save \
  --output-dir "$RUN_DIR/run" --num-cpus "$(nproc)" \
  --eval-prompt-data copy "$RUN_DIR/eval.jsonl" --n-samples-per-eval-prompt 1 --eval-temperature 0 \
  "$@"

# 3. Plot and summary: reward curve and time per phase.
"$PY" -m slime.report "$RUN_DIR/run"
