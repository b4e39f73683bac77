"""A random-initialised tiny HF checkpoint of any registered model_type (tests, quick start):
config.json + model.safetensors + an offline tokenizer, written by transformers, loadable by
AutoModelForCausalLM (or common/hf_classes.py's class) and by slime's Megatron loader. Each family supplies its
tiny config (`ModelFamily.tiny_config`).

    python -m slime_plugins.models.common.tiny OUT_DIR --model-type qwen3 [--override '{"tie_word_embeddings": true}']

`--warmup-steps N` (default 0: random init) then trains it briefly, supervised, on the synthetic string tasks
(common/warmup.py): the prior the GLM-5 quick start's RL starts from.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def tiny_model_types() -> list[str]:
    from slime_plugins.models.registry import families

    return sorted(t for f in families() if f.tiny_config for t in f.model_types)


def tiny_config(model_type: str, **overrides: Any):
    """The transformers config object of `model_type`'s tiny model."""
    from slime_plugins.models.registry import get_family

    family = get_family(model_type)
    if not family.tiny_config:
        raise ValueError(f"no tiny config for model_type {model_type!r}; choose one of {tiny_model_types()}")
    return family.call("tiny_config", model_type, **overrides)


def write_tiny_checkpoint(out_dir: str, model_type: str = "glm_moe_dsa", seed: int = 0, dtype: str = "float32",
                          warmup_steps: int = 0, warmup_tasks: str | None = None, **overrides: Any) -> str:
    """Write a random-init tiny HF checkpoint to `out_dir` (atomically: temp dir, then rename); with
    `warmup_steps` > 0, after `warmup_steps` supervised steps on `warmup_tasks` (common/warmup.py)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from slime.utils.tiny_tokenizer import save_tokenizer
    from slime_plugins.models.common.hf_classes import causal_lm_class

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    # a vision-language type (Qwen3.5, GLM-5.3-Flash) is written as its published checkpoints are: text model and
    # vision tower; a text-only type without a transformers causal-LM class (glm5_next_text): hf_classes.py's class
    model_class = causal_lm_class(model_type) if getattr(config, "vision_config", None) is None else None
    if model_class is not None:
        model = model_class._from_config(config, dtype=getattr(torch, dtype))
    else:
        auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    # Random-init e_score_correction_bias is zeros; give it values so the bias path is exercised.
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    if warmup_steps:
        from slime.utils.tiny_tokenizer import build_tokenizer
        from slime_plugins.models.common.warmup import DEFAULT_TASKS, warmup

        if dtype != "float32":
            raise ValueError(f"--warmup-steps needs a float32 model; {model_type} {dtype} is not")
        warmup(model, build_tokenizer(config.get_text_config().vocab_size), warmup_steps, seed=seed, tasks=warmup_tasks or DEFAULT_TASKS)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = mkdtemp_like_makedirs(prefix=".tmp-ckpt-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tmp, config.get_text_config().vocab_size)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def mkdtemp_like_makedirs(prefix: str, dir: str) -> str:
    """tempfile.mkdtemp, with the mode os.makedirs would give (0777 less the umask) instead of mkdtemp's 0700:
    the directory is renamed into the checkpoint, which other users and containers of the machine read."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix=prefix, dir=dir)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    return tmp


def transformers_config(model_type: str, base: dict[str, Any], overrides: dict[str, Any]):
    """`AutoConfig.for_model(model_type, **(base | overrides))`, the tiny configs' constructor."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **(base | overrides))


# Sizes shared by the tiny GQA models: 4 query heads over 2 key/value heads, head_dim 16.
TINY_GQA: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def main() -> None:  # pragma: no cover - CLI
    ap = argparse.ArgumentParser(description="Write a tiny random-init HF checkpoint of a registered model_type.")
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", default="glm_moe_dsa", choices=tiny_model_types())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", default="{}", help="JSON dict of config overrides")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="supervised steps on the synthetic tasks after init (default 0: random init)")
    ap.add_argument("--warmup-tasks", default=None,
                    help="comma-separated task[:min-max] specs of the warm-up (default: common/warmup.py's)")
    a = ap.parse_args()
    if a.warmup_steps < 0:
        ap.error(f"--warmup-steps must be >= 0, got {a.warmup_steps}")
    write_tiny_checkpoint(a.out_dir, a.model_type, a.seed, warmup_steps=a.warmup_steps, warmup_tasks=a.warmup_tasks,
                          **json.loads(a.override))
    print(a.out_dir)


if __name__ == "__main__":  # pragma: no cover
    main()
