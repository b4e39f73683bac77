# Device profile for NVIDIA GPU clusters, sourced by scripts/run-*.sh when
# `python -m slime.accelerator --name` prints "cuda". Parallel sizes and memory settings only:
# the device environment (NCCL settings, visible devices) comes from the accelerator itself.
# Every value can be overridden from the environment. Sized with `python -m slime.plan`
# (see docs/planner.md) for GLM-5.3-Flash (glm5_next, 313.8B) on 4 nodes x 8 H200.

PLAN_DEVICE=${PLAN_DEVICE:-h200}                  # planner device profile (slime/plan/devices.py)
NUM_NODES=${NUM_NODES:-4}                         # trainer nodes (--actor-num-nodes)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                 # devices per node (--actor-num-gpus-per-node)

# Megatron layout, as the trainer runs it: expert-TP 1 (the model keeps experts whole), pipeline
# parallel 4, the distributed optimizer with its state in host memory (--optimizer-cpu-offload) and full
# activation recompute: 65 GB train phase, 113 GB peak in the rollout phase of 126 GB usable (planner).
# The planner's fewest H200 nodes (python -m slime.plan --model glm5.3-flash --fewest h200): 4 x 8 with
# the CPU offload, 8 x 8 without it. EP divides the 288 experts (8: 36 per rank). Context parallel does
# not lower these counts (docs/planner.md).
TP=${TP:-8}
PP=${PP:-4}
EP=${EP:-8}
CP=${CP:-1}
ETP=${ETP:-1}
RECOMPUTE=${RECOMPUTE:-full}                      # full | none (--recompute-granularity full, uniform, 1 layer)
OPTIMIZER_CPU_OFFLOAD=${OPTIMIZER_CPU_OFFLOAD:-1} # 1: --optimizer-cpu-offload (Megatron's hybrid optimizer)
# Packed micro-batch budget.
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-4096}

# Placement: colocated trainer + engines, each offloaded while the other runs (IPC weight sync).
COLOCATE=${COLOCATE:-1}
ROLLOUT_NUM_NODES=${ROLLOUT_NUM_NODES:-0}         # extra nodes for engines when COLOCATE=0
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-8}  # 600 GB of bf16 weights over 8 x 141 GB
SGLANG_MEM_FRACTION_STATIC=${SGLANG_MEM_FRACTION_STATIC:-0.8}
UPDATE_WEIGHT_MODE=${UPDATE_WEIGHT_MODE:-auto}    # ipc when colocated
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-1073741824}  # 1 GiB buckets
RAY_START_ARGS=${RAY_START_ARGS:-}                # Ray detects GPUs itself
