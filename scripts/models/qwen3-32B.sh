# Qwen3-32B (HF model_type qwen3): dense, GQA 64 heads / 8 KV groups, head dim 128, QK-norm, untied
# embeddings. Upstream slime's MODEL_ARGS; train.py checks them against config.json (configs/qwen3-32B.json).

MODEL_ARGS=(
   --swiglu
   --num-layers 64
   --hidden-size 5120
   --ffn-hidden-size 25600
   --num-attention-heads 64
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   --untie-embeddings-and-output-weights
)
