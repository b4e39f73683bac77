"""GLM-5 family (glm_moe_dsa, glm4_moe_lite) on Megatron-core."""
