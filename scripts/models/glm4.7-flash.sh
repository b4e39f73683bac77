# GLM-4.7-Flash (30B total / ~3B active; HF model_type glm4_moe_lite): MLA attention (no DSA indexer)
# + sigmoid-routed MoE (64 experts, top-4, one shared expert), 1 dense layer, 1 MTP layer.
# Sizes from the public GLM-4.7-Flash config (configs/glm4.7-30B-A3B.json).
#
# slime style: source this file to get MODEL_ARGS; checked against a checkpoint with
# `python -m slime.plan.model_args CHECKPOINT -- "${MODEL_ARGS[@]}"`.

MODEL_ARGS=(
   --num-layers 47
   --hidden-size 2048
   --ffn-hidden-size 10240
   --num-attention-heads 20
   --multi-latent-attention
   --qk-layernorm  # MLA: RMSNorm on the q and kv latents (q_a_layernorm, kv_a_layernorm)
   --q-lora-rank 768
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --num-experts 64
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 4
   --moe-layer-freq "[0]*1+[1]*46"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 1.8
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
