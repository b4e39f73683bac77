# GLM-5.3-Flash (~300B total, ~20B active): the GLM-5 architecture (HF model_type glm_moe_dsa:
# MLA attention + DSA sparse-attention indexer + sigmoid-routed MoE with a shared expert).
#
# NO PUBLIC CONFIG EXISTS for GLM-5.3-Flash. The sizes below are ASSUMED: GLM-5's layer design
# (head dims, kv_lora, indexer, 256 experts top-8, 3 dense layers, vocab) scaled to ~300B with
# hidden 5120, 60 layers, q_lora 1536 and expert width 1280. slime.plan counts 298.7B parameters
# (304.0B with the MTP layer) and 20.0B active per token. Replace these with the real config when
# it is published; configs/glm5.3-flash-300B.json holds the same shape as an HF config.json and
# tests/test_docker_and_scripts.py checks the two agree.
#
# slime style: source this file to get MODEL_ARGS (Megatron flag names). train.py reads the
# architecture from --hf-checkpoint's config.json; run scripts verify MODEL_ARGS against it with
# `python -m slime.plan.model_args`.

MODEL_ARGS=(
   --num-layers 60
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 64
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 192
   --qk-pos-emb-head-dim 64
   --v-head-dim 256
   --dsa-indexer-n-heads 32
   --dsa-indexer-head-dim 128
   --dsa-indexer-topk 2048
   --num-experts 256
   --moe-ffn-hidden-size 1280
   --moe-shared-expert-intermediate-size 1280
   --moe-router-topk 8
   --moe-layer-freq "[0]*3+[1]*57"
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
