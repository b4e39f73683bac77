# GLM-5.3-Flash (zai-org/GLM-5.3-Flash, HF model_type glm5_next): 313.8B parameters, 17.4B active per token
# (transformers 5.24, counted on the meta device), natively multimodal (a 0.46B vision tower).
#
# A hybrid decoder of 45 layers: Kimi Delta Attention (KDA, linear attention with a per-channel forget gate
# and a recurrent state) on 34 of them and, on every fourth (3, 7, ..., 43), DSA: MLA without a rotary part
# (NoPE: qk_rope_head_dim 0) plus a lightning indexer over k-pool compressed keys. mHC hyper-connections carry
# 4 residual streams around every block. First 3 layers dense, then 288 routed experts (sigmoid top-8 with
# expert bias, scaling 2.5) and one shared expert; SwiGLU clamped at 10; one MTP layer. The values are
# scripts/models/configs/glm5.3-flash.json (transformers' Glm5NextConfig defaults, which are the checkpoint's).
#
# Megatron-core has no flags for mHC, the k-pool indexer or KDA's gates: they come from config.json, like
# every architecture detail. KDA's layer pattern and sizes use Megatron's linear-attention flags.
#
# slime style: source this file to get MODEL_ARGS (Megatron flag names). train.py reads the
# architecture from --hf-checkpoint's config.json and checks MODEL_ARGS against it when they are passed
# (`python train.py "${MODEL_ARGS[@]}" --hf-checkpoint ...`); the planner checks them too
# (`python -m slime.plan.model_args`).

MODEL_ARGS=(
   --num-layers 45
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 64
   --multi-latent-attention
   --qk-layernorm
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 256
   --qk-pos-emb-head-dim 0
   --v-head-dim 256
   --dsa-indexer-n-heads 32
   --dsa-indexer-head-dim 128
   --dsa-indexer-topk 2048
   --linear-attention-freq 4
   --linear-num-key-heads 64
   --linear-num-value-heads 64
   --linear-key-head-dim 128
   --linear-value-head-dim 128
   --linear-conv-kernel-dim 4
   --num-experts 288
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "[0]*3+[1]*42"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --activation-func-clamp-value 10
   --mtp-num-layers 1
   --vocab-size 154880
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --swiglu
   --disable-bias-linear
   --untie-embeddings-and-output-weights
   --position-embedding-type none
)
