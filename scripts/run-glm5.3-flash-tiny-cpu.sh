#!/usr/bin/env bash
# Quick start: GRPO on a tiny GLM-5.3-Flash (glm5_next, the multimodal checkpoint as published: KDA linear-
# attention layers, DSA layers of which one reuses the previous layer's indexer top-k, mHC hyper-connections,
# routed + shared experts, a dense first layer, a frozen vision tower; no MTP layer) that learns to answer in the
# format its reward pays for. The task: "answer : c a d =" is answered by a copy of the string, and the reward
# pays only for the copy after the word `answer` ("answer c a d"), 0 for the bare copy. The checkpoint is random
# init plus a short supervised warm-up that teaches both forms, the paid one in 30% of its examples, so the prior
# is paid 0.14-0.33 of the time at rollout 0 and GRPO has to select the paid form (docs/training.md, "What the quick start
# learns"). Trainer (Megatron) and rollout engine are colocated under Ray; weights go to the engine through IPC
# after every step. On a CPU machine (~2 cores, a few minutes): the embedded engine and shared-memory IPC. The
# same script, unchanged, runs on a GPU or NPU machine: the accelerator is detected (SLIME_ACCELERATOR
# overrides), the engine is SGLang where installed, and the weight-sync transport is the device's (IPC, or a
# collective broadcast where the device has no IPC).
#
# Environment knobs: RUN_DIR (outputs, default outputs/glm5.3-flash-tiny), NUM_ROLLOUT (default 40),
# WARMUP_STEPS (supervised steps of the checkpoint, default 250; 0 is the random-init model).
# Held-out reward: 32 prompts of another seed, left out of the training prompts, 2 samples each at temperature
# 1, before training and every 5 rollouts (eval records in metrics.jsonl, the held-out curve in report.png).
# Extra arguments are passed to train.py (e.g. --num-rollout 10).
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
# One thread per trainer rank and engine on CPU (ignored on GPU/NPU): the tiny model's ops are too small to share
# between threads, and on a loaded host two threads each made a train step 20x slower (8.9 s CPU vs 0.41 s).
export SLIME_CPU_THREADS="${SLIME_CPU_THREADS:-1}"

RUN_DIR="${RUN_DIR:-$ROOT/outputs/glm5.3-flash-tiny}"
NUM_ROLLOUT="${NUM_ROLLOUT:-40}"
WARMUP_STEPS="${WARMUP_STEPS:-250}"
ACCELERATOR="$("$PY" -m slime.accelerator --name)"
echo "accelerator: $ACCELERATOR   run dir: $RUN_DIR"
mkdir -p "$RUN_DIR"

# 1. The tiny GLM-5.3-Flash checkpoint (random init, seed 0, then WARMUP_STEPS supervised steps on the answer
#    task's two forms; offline tokenizer), the held-out prompts and the training prompts without them.
[ -f "$RUN_DIR/model/config.json" ] || "$PY" -m slime_plugins.models.common.tiny "$RUN_DIR/model" \
  --model-type glm5_next --warmup-steps "$WARMUP_STEPS" --warmup-tasks answer:2-4
[ -f "$RUN_DIR/eval.jsonl" ] || "$PY" -m slime.rollout.synthetic --out "$RUN_DIR/eval.jsonl" --num 32 --seed 1 \
  --tasks answer --min-len 2 --max-len 4
[ -f "$RUN_DIR/data.jsonl" ] || "$PY" -m slime.rollout.synthetic --out "$RUN_DIR/data.jsonl" --num 4096 --seed 0 \
  --tasks answer --min-len 2 --max-len 4 --exclude "$RUN_DIR/eval.jsonl"

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
  --eval-prompt-data answer "$RUN_DIR/eval.jsonl" --n-samples-per-eval-prompt 2 --eval-temperature 1.0 \
  --eval-interval 5 \
  "$@"

# 3. Plot and summary: train and held-out reward curves (the prior's level marked) and time per phase.
"$PY" -m slime.report "$RUN_DIR/run"
