# Qwen3-30B-A3B (HF model_type qwen3_moe): GQA 32 heads / 4 KV groups, QK-norm; every one of the 48 layers
# is MoE (128 experts, top-8, softmax router, no shared expert). Upstream slime's MODEL_ARGS; train.py checks
# them against config.json (configs/qwen3-30B-A3B.json). MODEL_ARGS_ROTARY_BASE overrides the rotary base.

MODEL_ARGS=(
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --qk-layernorm
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-percent 1.0
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151936
   --moe-layer-freq "[1]*48"
   --num-experts 128
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
   --moe-grouped-gemm
   --moe-permute-fusion
)
