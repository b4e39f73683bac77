# GLM-4.7-Flash 30B-A3B (HF model_type glm4_moe_lite): MLA, 64 routed experts top-4 + 1 shared,
# 1 dense layer then 46 MoE layers. Upstream slime's MODEL_ARGS (Megatron flag names) for this model;
# train.py checks them against --hf-checkpoint's config.json (shape: configs/glm4.7-30B-A3B.json).
# (--add-qkv-bias has no effect with MLA, in Megatron as here.)

MODEL_ARGS=(
   --num-layers 47
   --hidden-size 2048
   --ffn-hidden-size 10240
   --num-attention-heads 20
   --multi-latent-attention
   --q-lora-rank 768
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --kv-channels 192
   --qk-layernorm
   --add-qkv-bias
   --moe-layer-freq "[0]*1+[1]*46"
   --num-experts 64
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 4
   --moe-router-topk-scaling-factor 1.8
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-grouped-gemm
   --moe-permute-fusion
   --make-vocab-size-divisible-by 64
   --vocab-size 154880
   --disable-bias-linear
   --swiglu
   --untie-embeddings-and-output-weights
   --normalization RMSNorm
   --position-embedding-type rope
   --no-position-embedding
   --rotary-base 1000000
   --no-rope-fusion
)
