# GLM-5 (744B total / 40B active; HF model_type glm_moe_dsa): MLA attention + DSA sparse-attention
# indexer + sigmoid-routed MoE (256 experts, top-8, one shared expert), 3 dense layers, 1 MTP layer.
# Sizes from the public GLM-5 config (configs/glm5-744B-A40B.json holds the same shape as an HF config.json).
#
# slime style: source this file to get MODEL_ARGS (Megatron flag names). train.py reads the
# architecture from --hf-checkpoint's config.json; run scripts verify MODEL_ARGS against it with
# `python -m slime.plan.model_args CHECKPOINT -- "${MODEL_ARGS[@]}"`.

MODEL_ARGS=(
   --num-layers 78
   --hidden-size 6144
   --ffn-hidden-size 12288
   --num-attention-heads 64
   --multi-latent-attention
   --qk-layernorm  # MLA: RMSNorm on the q and kv latents (q_a_layernorm, kv_a_layernorm)
   --q-lora-rank 2048
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --dsa-indexer-n-heads 32
   --dsa-indexer-head-dim 128
   --dsa-indexer-topk 2048
   --num-experts 256
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "[0]*3+[1]*75"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --mtp-num-layers 1
   --vocab-size 154880
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --swiglu
   --disable-bias-linear
   --untie-embeddings-and-output-weights
   --position-embedding-type rope
   --rotary-base 1000000
)
