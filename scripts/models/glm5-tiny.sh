# Tiny GLM-5 (HF model_type glm_moe_dsa) for CPU runs and tests: the GLM-5 layer design at toy size
# (hidden 64, 3 layers of which 1 dense, 8 experts in 2 groups, top-2, DSA top-8, vocab 512).
# The checkpoint comes from `python -m slime_plugins.models.glm5.tiny OUT_DIR` (random init,
# safetensors + config.json + an offline tokenizer); the values below are its TINY_GLM5 config.
#
# slime style: source this file to get MODEL_ARGS; checked against a checkpoint with
# `python -m slime.plan.model_args CHECKPOINT -- "${MODEL_ARGS[@]}"`.

MODEL_ARGS=(
   --num-layers 3
   --hidden-size 64
   --ffn-hidden-size 128
   --num-attention-heads 4
   --multi-latent-attention
   --qk-layernorm  # MLA: RMSNorm on the q and kv latents (q_a_layernorm, kv_a_layernorm)
   --q-lora-rank 32
   --kv-lora-rank 16
   --qk-head-dim 16
   --qk-pos-emb-head-dim 8
   --v-head-dim 16
   --dsa-indexer-n-heads 2
   --dsa-indexer-head-dim 16
   --dsa-indexer-topk 8
   --num-experts 8
   --moe-ffn-hidden-size 32
   --moe-shared-expert-intermediate-size 32
   --moe-router-topk 2
   --moe-layer-freq "[0]*1+[1]*2"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 2
   --moe-router-group-topk 1
   --vocab-size 512
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --swiglu
   --disable-bias-linear
   --untie-embeddings-and-output-weights
   --position-embedding-type rope
   --rotary-base 10000
)
