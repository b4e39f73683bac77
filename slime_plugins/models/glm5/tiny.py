"""Tiny GLM-5-family configs and a random-initialised HF checkpoint writer (tests, quick start).

`write_tiny_checkpoint(out_dir)` writes config.json + model.safetensors + an offline tokenizer,
loadable by transformers' AutoModelForCausalLM and by slime's Megatron loader.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

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


def write_tiny_checkpoint(out_dir: str, model_type: str = "glm_moe_dsa", seed: int = 0, dtype: str = "float32",
                          **overrides: Any) -> str:
    """Write a random-init tiny HF checkpoint to `out_dir` (atomically: temp dir, then rename)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from slime.utils.tiny_tokenizer import save_tokenizer

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Random-init e_score_correction_bias is zeros; give it values so the bias path is exercised.
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tmp, config.vocab_size)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main() -> None:  # pragma: no cover - CLI
    ap = argparse.ArgumentParser(description="Write a tiny random-init GLM-5-family HF checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", default="glm_moe_dsa", choices=sorted(TINY_CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", default="{}", help="JSON dict of config overrides")
    a = ap.parse_args()
    write_tiny_checkpoint(a.out_dir, a.model_type, a.seed, **json.loads(a.override))
    print(a.out_dir)


if __name__ == "__main__":  # pragma: no cover
    main()
