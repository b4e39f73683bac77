# GLM-4.7 355B-A32B (the GLM-4.5 architecture, HF model_type glm4_moe): GQA 96 heads / 8 KV groups with
# QK-norm, qkv bias and half-dimension rotary; 160 routed experts top-8 + 1 shared, 3 dense then 89 MoE
# layers. Upstream slime's MODEL_ARGS (its scripts/models/glm4.5-355B-A32B.sh, which its GLM-4.7 run script
# sources); train.py checks them against config.json (shape: configs/glm4.7-355B-A32B.json).

MODEL_ARGS=(
   --num-layers 92
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --add-qkv-bias
   --disable-bias-linear
   --normalization RMSNorm
   --position-embedding-type rope
   --rotary-percent 0.5
   --rotary-base 1000000
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151552
   --moe-layer-freq "[0]*3+[1]*89"
   --num-experts 160
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-router-topk-scaling-factor 2.5
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
