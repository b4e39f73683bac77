# Device profile for NVIDIA GPU clusters, sourced by scripts/run-*.sh when
# `python -m slime.accelerator --name` prints "cuda". Parallel sizes and memory settings only:
# the device environment (NCCL settings, visible devices) comes from the accelerator itself.
# Every value can be overridden from the environment. Sized with `python -m slime.plan`
# (see docs/planner.md) for GLM-5.3-Flash 300B on 16 nodes x 8 H200.

PLAN_DEVICE=${PLAN_DEVICE:-h200}                  # planner device profile (slime/plan/devices.py)
NUM_NODES=${NUM_NODES:-16}                        # trainer nodes (--actor-num-nodes)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                 # devices per node (--actor-num-gpus-per-node)

# Megatron layout, as the trainer runs it: expert-TP 1 (the GLM model keeps experts whole), no
# pipeline or context parallel, a full optimizer state per data-parallel rank (no distributed
# optimizer) and no activation recompute. Under those, 16 x 8 H200 fit only with every rank holding
# 2 of the 256 experts (EP 128, 103 GB train phase): EP 64 needs 143 GB, EP 16 385 GB per device.
TP=${TP:-8}
PP=${PP:-1}
EP=${EP:-128}
CP=${CP:-1}
ETP=${ETP:-1}
# Packed micro-batch budget: the planner's largest that fits without activation recompute.
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-4096}

# Placement: colocated trainer + engines, each offloaded while the other runs (IPC weight sync).
COLOCATE=${COLOCATE:-1}
ROLLOUT_NUM_NODES=${ROLLOUT_NUM_NODES:-0}         # extra nodes for engines when COLOCATE=0
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-8}  # 600 GB of bf16 weights over 8 x 141 GB
SGLANG_MEM_FRACTION_STATIC=${SGLANG_MEM_FRACTION_STATIC:-0.8}
UPDATE_WEIGHT_MODE=${UPDATE_WEIGHT_MODE:-auto}    # ipc when colocated
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-1073741824}  # 1 GiB buckets
RAY_START_ARGS=${RAY_START_ARGS:-}                # Ray detects GPUs itself
