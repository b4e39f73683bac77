"""slime-style MODEL_ARGS (Megatron flag names, from scripts/models/*.sh) <-> HF config keys.

train.py takes the architecture from the checkpoint's config.json, so run scripts do not pass
MODEL_ARGS to it; they check them against the checkpoint instead (a wrong checkpoint fails before
any device is touched):

    python -m slime.plan.model_args CONFIG_OR_NAME -- "${MODEL_ARGS[@]}"
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Sequence

from slime.plan.hybrid import HYBRID_MODEL_TYPES, TEXT_DEFAULTS, text_config
from slime.plan.model import load_config

# flag -> (HF key, type). Values compare after conversion; flags without a value are booleans.
VALUE_FLAGS: dict[str, tuple[str, type]] = {
    "--num-layers": ("num_hidden_layers", int),
    "--hidden-size": ("hidden_size", int),
    "--ffn-hidden-size": ("intermediate_size", int),
    "--num-attention-heads": ("num_attention_heads", int),
    "--q-lora-rank": ("q_lora_rank", int),
    "--kv-lora-rank": ("kv_lora_rank", int),
    "--qk-head-dim": ("qk_nope_head_dim", int),  # Megatron's MLA "qk head dim" is the no-rope part
    "--qk-pos-emb-head-dim": ("qk_rope_head_dim", int),
    "--v-head-dim": ("v_head_dim", int),
    "--dsa-indexer-n-heads": ("index_n_heads", int),
    "--dsa-indexer-head-dim": ("index_head_dim", int),
    "--dsa-indexer-topk": ("index_topk", int),
    "--num-experts": ("n_routed_experts", int),
    "--moe-ffn-hidden-size": ("moe_intermediate_size", int),
    "--moe-router-topk": ("num_experts_per_tok", int),
    "--moe-router-topk-scaling-factor": ("routed_scaling_factor", float),
    "--moe-router-num-groups": ("n_group", int),
    "--moe-router-group-topk": ("topk_group", int),
    "--mtp-num-layers": ("num_nextn_predict_layers", int),
    "--vocab-size": ("vocab_size", int),
    "--norm-epsilon": ("rms_norm_eps", float),
    "--rotary-base": ("rope_theta", float),
    # KDA (glm5_next's linear attention) under Megatron's linear-attention names: one head count and head dim
    "--linear-conv-kernel-dim": ("linear_conv_kernel_dim", int),
    "--linear-key-head-dim": ("linear_head_dim", int),
    "--linear-value-head-dim": ("linear_head_dim", int),
    "--linear-num-key-heads": ("linear_num_heads", int),
    "--linear-num-value-heads": ("linear_num_heads", int),
    "--activation-func-clamp-value": ("swiglu_limit", float),  # clamped SwiGLU: gate <= v, -v <= up <= v
}
DERIVED_FLAGS = ("--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--linear-attention-freq")
SWITCHES = ("--multi-latent-attention", "--moe-router-enable-expert-bias", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--qk-layernorm")  # MLA's q_a / kv_a latent norms
FIXED = {"--normalization": "RMSNorm", "--moe-router-score-function": "sigmoid", "--position-embedding-type": "rope"}
# glm5_next has no rotary part anywhere in its text model (KDA, NoPE MLA): Megatron's "none"
HYBRID_FIXED = FIXED | {"--position-embedding-type": "none"}


def parse_model_args(argv: Sequence[str]) -> dict[str, Any]:
    """MODEL_ARGS -> {flag: value} (switches map to True). Unknown flags are an error."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag in SWITCHES:
            out[flag] = True
            i += 1
            continue
        if flag not in VALUE_FLAGS and flag not in DERIVED_FLAGS and flag not in FIXED:
            raise ValueError(f"MODEL_ARGS: unknown flag {flag!r}; known: {', '.join(sorted(VALUE_FLAGS) + list(DERIVED_FLAGS))}")
        if i + 1 >= len(argv):
            raise ValueError(f"MODEL_ARGS: {flag} needs a value")
        out[flag] = argv[i + 1]
        i += 2
    return out


def _dense_layers(freq: str, n_layers: int) -> int:
    """'[0]*3+[1]*57' -> 3 (leading dense layers); the pattern must cover exactly n_layers."""
    m = re.fullmatch(r"\[0\]\*(\d+)\+\[1\]\*(\d+)", freq.replace(" ", ""))
    if not m:
        raise ValueError(f"--moe-layer-freq {freq!r}: expected the form '[0]*K+[1]*N'")
    k, n = int(m.group(1)), int(m.group(2))
    if k + n != n_layers:
        raise ValueError(f"--moe-layer-freq {freq!r} covers {k + n} layers but --num-layers is {n_layers}")
    return k


def _linear_layer_types(freq: str, n_layers: int) -> list[str]:
    """Megatron's --linear-attention-freq (N: every N-th layer full attention, the rest linear; or a list
    expression of 1 = linear, 0 = full per layer) as glm5_next's layer_types."""
    text = freq.replace(" ", "")
    if text.isdigit():
        pattern = [0 if (i + 1) % int(text) == 0 else 1 for i in range(n_layers)]
    else:
        pattern = []
        for term in text.split("+"):
            m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", term)
            if not m:
                raise ValueError(f"--linear-attention-freq {freq!r}: expected N or a list expression like '[1,1,1,0]*11+[1]'")
            pattern += [int(v) for v in m.group(1).split(",")] * int(m.group(2) or 1)
    if len(pattern) != n_layers:
        raise ValueError(f"--linear-attention-freq {freq!r} covers {len(pattern)} layers but --num-layers is {n_layers}")
    return ["linear_attention" if v else "indexed_attention" for v in pattern]


def to_hf_config(argv: Sequence[str]) -> dict[str, Any]:
    """The HF config keys MODEL_ARGS determine (model_type glm5_next with the linear-attention flags,
    glm_moe_dsa with the DSA flags, else glm4_moe_lite)."""
    a = parse_model_args(argv)
    cfg: dict[str, Any] = {}
    for flag, (key, typ) in VALUE_FLAGS.items():
        if flag in a:
            if key in cfg and cfg[key] != typ(a[flag]):
                raise ValueError(f"MODEL_ARGS: {flag} {a[flag]} disagrees with another flag setting {key} to {cfg[key]} "
                                 "(KDA has one head count and one head dim for q, k and v)")
            cfg[key] = typ(a[flag])
    hybrid = "--linear-attention-freq" in a
    cfg["model_type"] = "glm5_next" if hybrid else "glm_moe_dsa" if "index_n_heads" in cfg else "glm4_moe_lite"
    if hybrid:
        cfg["layer_types"] = _linear_layer_types(a["--linear-attention-freq"], cfg.get("num_hidden_layers", 0))
    n = cfg.get("num_hidden_layers", 0)
    if "--moe-layer-freq" in a:
        cfg["first_k_dense_replace"] = _dense_layers(a["--moe-layer-freq"], n)
    if "--moe-shared-expert-intermediate-size" in a:
        shared, per = int(a["--moe-shared-expert-intermediate-size"]), cfg.get("moe_intermediate_size", 0)
        if not per or shared % per:
            raise ValueError("--moe-shared-expert-intermediate-size must be a multiple of --moe-ffn-hidden-size")
        cfg["n_shared_experts"] = shared // per
    cfg["tie_word_embeddings"] = not a.get("--untie-embeddings-and-output-weights", False)
    for flag, want in (HYBRID_FIXED if hybrid else FIXED).items():
        if flag in a and a[flag] != want:
            raise ValueError(f"MODEL_ARGS: {flag} {a[flag]} is not supported by the {cfg['model_type']} model; use {want}")
    if "--multi-latent-attention" not in a:
        raise ValueError("MODEL_ARGS: GLM-5 family models need --multi-latent-attention")
    return cfg


def _hybrid_value(cfg: dict[str, Any], key: str) -> Any:
    """A glm5_next config's value: its text model's fields (transformers' defaults where the config omits
    one), the dense-layer count from mlp_layer_types, and the family for model_type."""
    t = TEXT_DEFAULTS | text_config(cfg)
    n = int(t["num_hidden_layers"])
    if key == "model_type":
        return "glm5_next"  # the multimodal checkpoint and the flat text-only one alike
    if key == "tie_word_embeddings":
        return bool(cfg.get(key, t[key]))
    if key == "layer_types":
        return t.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    if key == "first_k_dense_replace":
        types = t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        k = types.count("dense")
        return k if types[:k] == ["dense"] * k else types
    return t.get(key)


def _hf_value(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get("model_type") in HYBRID_MODEL_TYPES:
        return _hybrid_value(cfg, key)
    if key == "rope_theta":
        return (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if key == "tie_word_embeddings":
        return bool(cfg.get(key, False))
    return cfg.get(key)


def _short(value: Any) -> str:
    """A per-layer list as the layers that are not KDA (one line), anything else as repr."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return f"attention (not linear) at layers {[i for i, v in enumerate(value) if v != 'linear_attention']}"
    return repr(value)


def mismatches(argv: Sequence[str], hf_config: dict[str, Any]) -> list[str]:
    """'key: MODEL_ARGS x != config y' for every key MODEL_ARGS sets that the config disagrees with."""
    want = to_hf_config(argv)
    out = []
    for key, value in want.items():
        have = _hf_value(hf_config, key)
        if have is None and key == "num_nextn_predict_layers" and hf_config.get("model_type") in HYBRID_MODEL_TYPES:
            continue  # transformers' glm5_next config does not state the checkpoint's MTP layers
        same = (abs(float(have) - float(value)) <= 1e-9 * max(1.0, abs(float(value)))
                if isinstance(value, float) and have is not None else have == value)
        if not same:
            out.append(f"{key}: MODEL_ARGS {_short(value)} != config {_short(have)}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m slime.plan.model_args CONFIG_OR_NAME -- MODEL_ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m slime.plan.model_args")
    ap.add_argument("config", help="config.json, checkpoint dir or registry name")
    a = ap.parse_args(argv[:split])
    try:
        name, cfg = load_config(a.config)
        bad = mismatches(argv[split + 1:], cfg)
    except ValueError as e:
        print(f"slime.plan.model_args: {e}", file=sys.stderr)
        return 2
    if bad:
        print(f"slime.plan.model_args: MODEL_ARGS do not match {a.config}: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print(f"MODEL_ARGS match {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
