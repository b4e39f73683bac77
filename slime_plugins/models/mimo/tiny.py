"""A tiny random MiMo checkpoint (tests): transformers ships no `mimo` type, so the main model is a tiny Qwen2
written by transformers, the MTP layers (published MiMoMTPLayers names) are added as seeded random tensors, and
config.json becomes MiMo's (model_type mimo, num_nextn_predict_layers)."""

from __future__ import annotations

import json
import os
import shutil

import torch

MTP_NORMS = ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm", "post_attention_layernorm")


def mtp_tensors(cfg: dict, layers: int, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    out = {}
    for k in range(layers):
        p = f"model.mtp_layers.{k}"
        out |= {f"{p}.{n}.weight": 1.0 + rand(h) for n in MTP_NORMS}
        out |= {f"{p}.input_proj.weight": rand(h, 2 * h),
                f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.q_proj.bias": rand(q),
                f"{p}.self_attn.k_proj.weight": rand(kv, h), f"{p}.self_attn.k_proj.bias": rand(kv),
                f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.v_proj.bias": rand(kv),
                f"{p}.self_attn.o_proj.weight": rand(h, q),
                f"{p}.mlp.gate_proj.weight": rand(i, h), f"{p}.mlp.up_proj.weight": rand(i, h),
                f"{p}.mlp.down_proj.weight": rand(h, i)}
    return out


def write_tiny_mimo_checkpoint(out_dir: str, seed: int = 0, mtp_layers: int = 1, **overrides) -> str:
    """A tiny qwen2 checkpoint plus `mtp_layers` MTP layers, as MiMo (written atomically: temp dir, then rename)."""
    from safetensors.torch import load_file, save_file

    from slime_plugins.models.common.tiny import mkdtemp_like_makedirs, write_tiny_checkpoint

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = mkdtemp_like_makedirs(prefix=".tmp-mimo-", dir=parent)
    try:
        ckpt = write_tiny_checkpoint(os.path.join(tmp, "ckpt"), "qwen2", seed=seed,
                                     **({"tie_word_embeddings": False} | overrides))
        with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        weights = os.path.join(ckpt, "model.safetensors")
        tensors = load_file(weights)
        std = float(cfg.get("initializer_range", 0.02))
        save_file(tensors | mtp_tensors(cfg, mtp_layers, seed + 1, std), weights, metadata={"format": "pt"})
        cfg |= {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": mtp_layers}
        with open(os.path.join(ckpt, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(ckpt, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
