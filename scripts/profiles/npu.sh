# Device profile for Huawei Ascend NPU clusters, sourced by scripts/run-*.sh when
# `python -m slime.accelerator --name` prints "npu". Parallel sizes and memory settings only:
# the device environment (HCCL timeouts, task queue, allocator config, visible devices) comes
# from the accelerator itself. Every value can be overridden from the environment.
# Each value that differs from scripts/profiles/cuda.sh is listed with its reason in
# docs/ascend.md ("Ascend deviations"). Sized with `python -m slime.plan` for GLM-5.3-Flash (glm5_next,
# 313.8B; 288 experts, so EP is a divisor of 288: 32 below).
# NOTHING here has run on Ascend hardware yet.

PLAN_DEVICE=${PLAN_DEVICE:-950dt}                 # 950dt | 950pr | a3 (slime/plan/devices.py)

case "$PLAN_DEVICE" in
  a3)
    # Deviation: an Atlas A3 node exposes 16 devices of 64 GB (one per 910C die): half the token
    # budget, engines of one node's 16 dies (the launcher starts an engine on one node), TP 16 and
    # pipeline parallel 4: the planner's fewest A3 nodes for this layout family (51 of 55 GB usable).
    NUM_NODES=${NUM_NODES:-16}
    GPUS_PER_NODE=${GPUS_PER_NODE:-16}
    TP=${TP:-16}
    PP=${PP:-4}
    EP=${EP:-32}
    MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-2048}
    ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-16}
    ;;
  *)
    NUM_NODES=${NUM_NODES:-16}
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}             # assumed for Ascend 950 nodes
    TP=${TP:-8}
    PP=${PP:-2}
    EP=${EP:-32}                                  # 9 experts per rank
    if [ "$PLAN_DEVICE" = "950pr" ]; then
      # Deviation: the shipping 950PR (Atlas 350) has 112 GB (press figure), 99 GB usable: colocated,
      # 2048-token micro-batches, and context parallel 4: a sample of 2048 + 8192 tokens is a micro-batch
      # of its own, split over 4 devices (planner: 93.4 of 99 GB at its peak, the weight sync).
      MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-2048}
      CP=${CP:-4}
    else
      MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-4096}
    fi
    ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-8}
    ;;
esac
PP=${PP:-1}
CP=${CP:-1}
ETP=${ETP:-1}                                     # the trainer runs expert-TP 1
# Distributed optimizer always (the trainer's default); CPU offload off. Deviation: full recompute. KDA (34 of the
# 45 layers) has no NPU kernel on any SoC and its pure-torch reference keeps its float32 chunk intermediates for
# backward; the planner counts them (slime/plan/fallbacks.py): without recompute the 950DT layout needs 178 of 128.5
# GB usable and the A3 one 74.5 of 54.9; with it one layer at a time holds them (peaks 116.3 / 93.4 / 51.2 GB).
RECOMPUTE=${RECOMPUTE:-full}
OPTIMIZER_CPU_OFFLOAD=${OPTIMIZER_CPU_OFFLOAD:-0}

if [ "$PLAN_DEVICE" = "950dt" ]; then
  # Deviation: the Ascend 950DT has no IPC, so a colocated run cannot hand weights to its engines
  # through shared device memory, and the collective fallback would put two ranks of one HCCL
  # group on the same device. 950DT runs split trainer and engines onto different nodes
  # (8 more nodes = 8 engines of 8 devices) and broadcast the weights over HCCL.
  COLOCATE=${COLOCATE:-0}
  ROLLOUT_NUM_NODES=${ROLLOUT_NUM_NODES:-8}
  UPDATE_WEIGHT_MODE=${UPDATE_WEIGHT_MODE:-distributed}
else
  COLOCATE=${COLOCATE:-1}
  ROLLOUT_NUM_NODES=${ROLLOUT_NUM_NODES:-0}
  UPDATE_WEIGHT_MODE=${UPDATE_WEIGHT_MODE:-auto}
fi
SGLANG_MEM_FRACTION_STATIC=${SGLANG_MEM_FRACTION_STATIC:-0.8}
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-1073741824}
RAY_START_ARGS=${RAY_START_ARGS:-}                # Ray detects NPUs (resource "NPU") itself
