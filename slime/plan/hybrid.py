"""GLM-5.3-Flash (`glm5_next`) config.json -> the planner's ModelShape fields.

glm5_next is a hybrid stack: Kimi Delta Attention (KDA, linear attention with a recurrent state) on the
`linear_attention` layers, MLA without a rotary part plus a k-pool DSA indexer on the `indexed_attention`
layers, mHC hyper-connections (`hc_mult` residual streams) around every block, and a vision tower. The
fields and their defaults are transformers' `Glm5NextTextConfig` / `Glm5NextVisionConfig` (5.24), whose
defaults are the published checkpoint's. Counts follow transformers' modules parameter by parameter
(tests/test_plan_glm5_next.py compares them with a meta-device build of the whole model).
Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

HYBRID_MODEL_TYPES = ("glm5_next", "glm5_next_text")

# Glm5NextTextConfig defaults for the keys the planner reads (a published config.json states them all).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 288,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256,
    "num_experts_per_tok": 8, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "hc_mult": 4, "index_kpool": 16,
    "tie_word_embeddings": False, "attention_bias": False,
}
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 24, "hidden_size": 1024, "num_heads": 16, "in_channels": 3, "patch_size": 14, "temporal_patch_size": 2,
    "spatial_merge_size": 2, "out_hidden_size": 1536, "intermediate_size": 4096, "projection_intermediate_size": 10240,
    "attention_bias": True,
}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: `text_config` of a multimodal checkpoint, the top level of a flat one."""
    text = cfg.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(cfg)


def _layer_types(t: dict[str, Any], n: int) -> list[str]:
    """transformers' schedule when the config omits it: KDA where idx % 4 != 3, DSA (MLA) elsewhere."""
    types = t.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    types = ["indexed_attention" if x == "full_attention" else x for x in types]
    if len(types) != n or set(types) - {"linear_attention", "indexed_attention"}:
        raise ValueError(f"layer_types must list {n} entries of linear_attention / indexed_attention")
    return types


def _indexer_types(t: dict[str, Any], n: int) -> list[str]:
    types = t.get("indexer_types")
    if types is None:
        pattern = t.get("index_topk_pattern")
        if pattern is not None:
            return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        freq, offset = max(int(t.get("index_topk_freq", 1)), 1), int(t.get("index_skip_topk_offset", 2))
        return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    return list(types)


def _dense_layers(t: dict[str, Any], n: int) -> int:
    """Leading dense MLP layers from `mlp_layer_types` (transformers' default: the first 3)."""
    types = t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    k = types.count("dense")
    if types[:k] != ["dense"] * k:
        raise ValueError("mlp_layer_types: the planner expects the dense layers first, then the sparse ones")
    return k


def vision_param_count(cfg: dict[str, Any]) -> int:
    """Parameters of transformers' Glm5NextVisionModel (patch embedding, blocks, downsample, merger)."""
    if not isinstance(cfg.get("vision_config"), dict):
        return 0  # a flat text-only checkpoint
    v = VISION_DEFAULTS | cfg["vision_config"]
    h, heads, inter, out, proj = (int(v[k]) for k in ("hidden_size", "num_heads", "intermediate_size",
                                                      "out_hidden_size", "projection_intermediate_size"))
    bias = 1 if v["attention_bias"] else 0
    patch = h * int(v["in_channels"]) * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2 + h
    block = (2 * h  # norm1, norm2
             + 3 * h * h + 3 * h * bias + h * h + h * bias  # qkv, proj
             + 2 * (h // heads)  # q_norm, k_norm (per head dim)
             + 2 * (inter * h + inter) + h * inter + h)  # gate, up, down (with biases)
    merge = int(v["spatial_merge_size"]) ** 2
    downsample = out * h * merge + out
    merger = out * out + 2 * out + 3 * proj * out  # proj, post-projection LayerNorm, gate/up/down
    return patch + int(v["depth"]) * block + downsample + merger + h  # + post_layernorm


def hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelShape keyword arguments of a glm5_next / glm5_next_text config.json."""
    t = TEXT_DEFAULTS | text_config(cfg)
    n = int(t["num_hidden_layers"])
    layers = _layer_types(t, n)
    indexers = _indexer_types(t, n)
    mla_ids = tuple(i for i, x in enumerate(layers) if x == "indexed_attention")
    return dict(
        model_type=str(cfg.get("model_type")), vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
        num_layers=n, dense_layers=_dense_layers(t, n), intermediate_size=int(t["intermediate_size"]),
        moe_intermediate_size=int(t["moe_intermediate_size"]), n_routed_experts=int(t["n_routed_experts"]),
        n_shared_experts=int(t["n_shared_experts"] or 0), top_k=int(t["num_experts_per_tok"]),
        num_heads=int(t["num_attention_heads"]), q_lora_rank=int(t["q_lora_rank"] or 0),
        kv_lora_rank=int(t["kv_lora_rank"]), qk_nope_head_dim=int(t["qk_nope_head_dim"]),
        qk_rope_head_dim=int(t["qk_rope_head_dim"]), v_head_dim=int(t["v_head_dim"]),
        index_n_heads=int(t["index_n_heads"]), index_head_dim=int(t["index_head_dim"]),
        index_topk=int(t["index_topk"]),
        indexer_layer_ids=tuple(i for i in mla_ids if indexers[i] == "full"),
        mtp_layers=int(t.get("num_nextn_predict_layers", cfg.get("num_nextn_predict_layers", 0)) or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t["tie_word_embeddings"])),
        attention_bias=bool(t["attention_bias"]),
        linear_layer_ids=tuple(i for i, x in enumerate(layers) if x == "linear_attention"),
        linear_num_heads=int(t["linear_num_heads"]), linear_head_dim=int(t["linear_head_dim"]),
        linear_conv_kernel=int(t["linear_conv_kernel_dim"]), hc_mult=int(t["hc_mult"]),
        index_kpool=int(t["index_kpool"]), vision_params=vision_param_count(cfg),
    )
