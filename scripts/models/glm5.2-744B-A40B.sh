# GLM-5.2 744B-A40B (HF model_type glm_moe_dsa): MLA + DSA indexer, 256 routed experts top-8 + 1 shared,
# 3 dense layers then 75 MoE layers; DSA cross-layer index sharing (index_topk_freq 4 in config.json).
# Upstream slime's MODEL_ARGS (Megatron flag names) for this model;
# train.py checks them against --hf-checkpoint's config.json (shape: configs/glm5.2-744B-A40B.json).
# Source this file, then pass "${MODEL_ARGS[@]}" to train.py.

MODEL_ARGS=(
   --spec "slime_plugins.models.glm5.glm5" "get_glm5_spec"
   --num-layers 78
   --hidden-size 6144
   --ffn-hidden-size 12288
   --num-attention-heads 64
   --multi-latent-attention
   --q-lora-rank 2048
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --kv-channels 192
   --qk-layernorm
   --moe-layer-freq "[0]*3+[1]*75"
   --num-experts 256
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-topk-scaling-factor 2.5
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-grouped-gemm
   --moe-permute-fusion
   --make-vocab-size-divisible-by 16
   --vocab-size 154880
   --disable-bias-linear
   --swiglu
   --untie-embeddings-and-output-weights
   --normalization RMSNorm
   --position-embedding-type rope
   --no-position-embedding
   --rotary-base 8000000
   --enable-experimental
   --allgather-cp
)
