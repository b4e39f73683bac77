"""Tiny GLM-5-family configs (tests, quick start); `python -m slime_plugins.models.glm5.tiny OUT_DIR`
writes one as a random-init HF checkpoint (the writer is common/tiny.py, for every family).
"""

from __future__ import annotations

from typing import Any

from slime_plugins.models.common.tiny import main, write_tiny_checkpoint

__all__ = ["TINY_CONFIGS", "main", "tiny_config", "write_tiny_checkpoint"]

TINY_GLM5: dict[str, Any] = dict(
    model_type="glm_moe_dsa",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,  # dense (first_k_dense_replace) layers
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,  # small so sequences longer than 8 make DSA drop tokens
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)

TINY_GLM47_FLASH: dict[str, Any] = {
    k: v for k, v in TINY_GLM5.items() if not k.startswith("index_")
} | dict(model_type="glm4_moe_lite", rope_interleave=True)

TINY_CONFIGS = {"glm_moe_dsa": TINY_GLM5, "glm4_moe_lite": TINY_GLM47_FLASH}


def tiny_config(model_type: str = "glm_moe_dsa", **overrides: Any):
    """A transformers config object for the tiny model of `model_type`."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for model_type {model_type!r}; choose one of {sorted(TINY_CONFIGS)}")
    kwargs = dict(TINY_CONFIGS[model_type]) | overrides
    kwargs.pop("model_type")
    n = kwargs["num_hidden_layers"]
    if model_type == "glm_moe_dsa":
        kwargs.setdefault("indexer_types", ["full"] * n)
        kwargs.setdefault("layer_types", ["indexed_attention"] * n)
    kwargs.setdefault("mlp_layer_types", ["dense"] * kwargs["first_k_dense_replace"] + ["sparse"] * (n - kwargs["first_k_dense_replace"]))
    return AutoConfig.for_model(model_type, **kwargs)


if __name__ == "__main__":  # pragma: no cover
    main()
