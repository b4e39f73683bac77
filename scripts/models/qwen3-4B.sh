# Qwen3-4B (HF model_type qwen3): dense, GQA 32 heads / 8 KV groups, head dim 128, QK-norm, tied
# embeddings. Upstream slime's MODEL_ARGS; train.py checks them against config.json (configs/qwen3-4B.json).
# MODEL_ARGS_ROTARY_BASE overrides the rotary base (as upstream's file allows).

MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
)
