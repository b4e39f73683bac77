"""Megatron model flags (upstream slime's MODEL_ARGS, from scripts/models/*.sh) on train.py's command line.

train.py builds the model from `--hf-checkpoint`'s config.json, so MODEL_ARGS do not choose the
architecture here; they are checked against config.json instead (a wrong checkpoint or a wrong
MODEL_ARGS file fails before any device is touched), one line per disagreement:

    --num-layers 80: config.json says num_hidden_layers=78

Architecture switches (`--swiglu`, `--untie-embeddings-and-output-weights`, ...) are compared both
ways once any architecture flag is given: leaving one out means Megatron's default (e.g. tied
embeddings), and that must agree with the checkpoint too.
"""

from __future__ import annotations

import argparse
import ast
import math
from typing import Any, Callable

from slime.config.parser_helpers import add_argument_once as _add

# How each HF model_type reads MODEL_ARGS (which models the trainer can build: slime_plugins.models.registry).
# MLA families carry kv_lora_rank etc.; the others are GQA/MHA.
MLA_MODEL_TYPES = ("glm_moe_dsa", "glm4_moe_lite", "deepseek_v3", "kimi_k2")
# Qwen3-Next / Qwen3.5: output-gated attention, zero-centred norms (--apply-layernorm-1p), gated shared expert
HYBRID_QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
GQA_MODEL_TYPES = ("glm4_moe", "glm4", "qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mimo",
                   "minimax_m2") + HYBRID_QWEN
POST_NORMED = ("glm4",)  # RMSNorm on the attention and MLP outputs (Megatron: --post-self-attn/mlp-layernorm)
KNOWN_MODEL_TYPES = MLA_MODEL_TYPES + GQA_MODEL_TYPES
SOFTMAX_ROUTED = ("qwen3_moe", "qwen2_moe") + HYBRID_QWEN  # the other MoE families route with sigmoid + expert bias
SHARED_EXPERT_GATED = ("qwen2_moe",) + HYBRID_QWEN  # sigmoid(x . shared_expert_gate) scales the shared expert


class ModelArgsError(ValueError):
    """MODEL_ARGS that cannot be read (e.g. a malformed --moe-layer-freq). One line."""


def _rope(cfg: dict, key: str, default: Any = None) -> Any:
    """transformers 5 keeps rope settings in rope_parameters; published configs at top level."""
    params = cfg.get("rope_parameters") or {}
    return params.get(key, cfg.get(key, default))


def _rope_scaling(cfg: dict, key: str, default: Any = None) -> Any:
    """A rope-scaling setting (YaRN's factor, mscale, mscale_all_dim): transformers 5's rope_parameters or the
    published configs' rope_scaling dict; `default` when the checkpoint has no rope scaling."""
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return scaling.get(key, default)


def _rope_type(cfg: dict) -> str:
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def _yarn(cfg: dict, key: str, default: float) -> float | None:
    """A YaRN setting; None (the flag changes nothing) without YaRN rope scaling."""
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return scaling.get(key, default) if scaling.get("rope_type", scaling.get("type")) == "yarn" else None


def _mla(cfg: dict) -> bool:
    return cfg.get("model_type") in MLA_MODEL_TYPES or "kv_lora_rank" in cfg


def _nope(cfg: dict) -> bool:
    """No position embedding anywhere: MLA without a rotary part (glm5_next, whose other layers are KDA)."""
    return _mla(cfg) and cfg.get("qk_rope_head_dim") == 0


def _num_experts(cfg: dict) -> int | None:
    return cfg.get("n_routed_experts", cfg.get("num_experts", cfg.get("num_local_experts")))  # last: Mixtral-style


def moe_layer_pattern(cfg: dict) -> list[int] | None:
    """1 per MoE decoder layer, 0 per dense one, from the config (None for a dense model)."""
    n = cfg.get("num_hidden_layers")
    if not _num_experts(cfg) or n is None:
        return None
    if cfg.get("mlp_layer_types"):  # glm5_next: "dense" / "sparse" per layer
        return [int(t == "sparse") for t in cfg["mlp_layer_types"]]
    if "first_k_dense_replace" in cfg:
        k = int(cfg["first_k_dense_replace"])
        return [0] * k + [1] * (n - k)
    step, dense = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(n)]


def linear_attention_pattern(cfg: dict) -> list[int] | None:
    """1 per linear-attention layer (glm5_next's KDA, Qwen3-Next's Gated DeltaNet), 0 per softmax-attention one,
    from the config (None without linear attention). Megatron's --linear-attention-freq uses the same 1/0."""
    types = cfg.get("layer_types")
    if not types and cfg.get("full_attention_interval") and cfg.get("num_hidden_layers"):
        step = int(cfg["full_attention_interval"])  # older Qwen3-Next configs state the interval alone
        types = ["full_attention" if (i + 1) % step == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]
    if not types or "linear_attention" not in types:
        return None
    return [int(t == "linear_attention") for t in types]


def _layer_list(text: str, flag: str, example: str) -> Any:
    """A Megatron per-layer pattern flag's value: an int or a list expression, evaluated over a literal-only
    grammar (lists, ints, + and *)."""
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ModelArgsError(f"{flag} {text!r}: use an int or a list expression like '{example}'")

    try:
        value = ev(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ModelArgsError(f"{flag} {text!r} is not an expression ({e.msg})") from e
    if isinstance(value, list) and any(v not in (0, 1) for v in value):
        raise ModelArgsError(f"{flag} {text!r} must give a list of 0 and 1 per layer, like '{example}'")
    if isinstance(value, int) and value < 1:
        raise ModelArgsError(f"{flag} {value} must be >= 1")
    if not isinstance(value, (int, list)):
        raise ModelArgsError(f"{flag} {text!r}: use an int or a list expression like '{example}'")
    return value


def parse_layer_freq(text: str, num_layers: int | None) -> list[int]:
    """Megatron's --moe-layer-freq: an int N (layers 0, N, 2N, ... are MoE) or a list expression such as
    '[0]*3+[1]*75' or '[1, 1, 0]' (1 = MoE, 0 = dense)."""
    value = _layer_list(text, "--moe-layer-freq", "[0]*3+[1]*75")
    if isinstance(value, int):
        if num_layers is None:
            raise ModelArgsError(f"--moe-layer-freq {value} needs --num-layers")
        return [int(i % value == 0) for i in range(num_layers)]
    return value


def parse_linear_attention_freq(text: str, num_layers: int | None) -> list[int]:
    """Megatron's --linear-attention-freq: an int N (every N-th layer softmax attention, the N-1 before it linear)
    or a list expression such as '[1,1,1,0]*11+[1]' (1 = linear attention, 0 = softmax attention)."""
    value = _layer_list(text, "--linear-attention-freq", "[1,1,1,0]*11+[1]")
    if isinstance(value, int):
        if num_layers is None:
            raise ModelArgsError(f"--linear-attention-freq {value} needs --num-layers")
        return [int((i + 1) % value != 0) for i in range(num_layers)]
    return value


def _shared_expert_size(cfg: dict) -> int | None:
    if "shared_expert_intermediate_size" in cfg:
        return int(cfg["shared_expert_intermediate_size"])
    if not _num_experts(cfg):
        return None
    return int(cfg.get("n_shared_experts", 0) or 0) * int(cfg.get("moe_intermediate_size", 0))


def _qk_norm(cfg: dict) -> bool:
    if _mla(cfg) or cfg.get("model_type") in ("qwen3", "qwen3_moe") + HYBRID_QWEN:
        return True  # MLA: norms on the low-rank latents; Qwen3: q_norm/k_norm
    return bool(cfg.get("use_qk_norm", False))


def _qkv_bias(cfg: dict) -> bool | None:
    if _mla(cfg):
        return None  # Megatron's MLA has no fused qkv projection: the flag has no effect there
    if cfg.get("model_type") in ("qwen2", "qwen2_moe", "mimo"):
        return True
    return bool(cfg.get("attention_bias", cfg.get("model_type") == "glm4"))  # transformers' Glm4Config: true


# flag -> (type, what config.json says for it). A getter returning None means "not applicable / not stated".
Getter = Callable[[dict], Any]
VALUE_FLAGS: dict[str, tuple[type, Getter, str]] = {
    "--num-layers": (int, lambda c: c.get("num_hidden_layers"), "num_hidden_layers"),
    "--hidden-size": (int, lambda c: c.get("hidden_size"), "hidden_size"),
    "--ffn-hidden-size": (int, lambda c: c.get("intermediate_size"), "intermediate_size"),
    "--num-attention-heads": (int, lambda c: c.get("num_attention_heads"), "num_attention_heads"),
    "--num-query-groups": (int, lambda c: None if _mla(c) else c.get("num_key_value_heads"), "num_key_value_heads"),
    "--kv-channels": (int, lambda c: None if _mla(c) else c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
                      if "hidden_size" in c and "num_attention_heads" in c else None, "head_dim"),
    "--q-lora-rank": (int, lambda c: c.get("q_lora_rank"), "q_lora_rank"),
    "--kv-lora-rank": (int, lambda c: c.get("kv_lora_rank"), "kv_lora_rank"),
    "--qk-head-dim": (int, lambda c: c.get("qk_nope_head_dim"), "qk_nope_head_dim"),  # Megatron: the no-rope part
    "--qk-pos-emb-head-dim": (int, lambda c: c.get("qk_rope_head_dim"), "qk_rope_head_dim"),
    "--v-head-dim": (int, lambda c: c.get("v_head_dim"), "v_head_dim"),
    "--dsa-indexer-n-heads": (int, lambda c: c.get("index_n_heads"), "index_n_heads"),
    "--dsa-indexer-head-dim": (int, lambda c: c.get("index_head_dim"), "index_head_dim"),
    "--dsa-indexer-topk": (int, lambda c: c.get("index_topk"), "index_topk"),
    "--num-experts": (int, _num_experts, "n_routed_experts/num_experts"),
    "--moe-ffn-hidden-size": (int, lambda c: c.get("moe_intermediate_size"), "moe_intermediate_size"),
    "--moe-shared-expert-intermediate-size": (int, _shared_expert_size, "n_shared_experts*moe_intermediate_size"),
    "--moe-router-topk": (int, lambda c: c.get("num_experts_per_tok"), "num_experts_per_tok"),
    "--moe-router-topk-scaling-factor": (float, lambda c: c.get("routed_scaling_factor"), "routed_scaling_factor"),
    "--moe-router-num-groups": (int, lambda c: c.get("n_group"), "n_group"),
    "--moe-router-group-topk": (int, lambda c: c.get("topk_group"), "topk_group"),
    "--moe-router-score-function": (str, lambda c: None if not _num_experts(c) else
                                    "softmax" if c.get("model_type") in SOFTMAX_ROUTED else
                                    c.get("scoring_func", "sigmoid"), "router scoring (model_type)"),
    "--mtp-num-layers": (int, lambda c: c.get("num_nextn_predict_layers", 0), "num_nextn_predict_layers"),
    "--vocab-size": (int, lambda c: c.get("vocab_size"), "vocab_size"),
    "--max-position-embeddings": (int, lambda c: c.get("max_position_embeddings"), "max_position_embeddings"),
    "--norm-epsilon": (float, lambda c: c.get("rms_norm_eps"), "rms_norm_eps"),
    "--rotary-base": (float, lambda c: _rope(c, "rope_theta"), "rope_theta"),
    "--rotary-percent": (float, lambda c: None if _mla(c) else _rope(c, "partial_rotary_factor", 1.0),
                         "partial_rotary_factor"),
    "--rotary-scaling-factor": (float, lambda c: _rope_scaling(c, "factor", 1.0), "rope_scaling.factor"),
    # Megatron's YaRN defaults (mscale 1, mscale_all_dim 0) are transformers' for keys a config leaves out
    "--mscale": (float, lambda c: _yarn(c, "mscale", 1.0), "rope_scaling.mscale"),
    "--mscale-all-dim": (float, lambda c: _yarn(c, "mscale_all_dim", 0.0), "rope_scaling.mscale_all_dim"),
    "--normalization": (str, lambda c: "RMSNorm", "RMSNorm (every supported family)"),
    "--position-embedding-type": (str, lambda c: "none" if _nope(c) else "rope",
                                  "position embedding (none: NoPE MLA, qk_rope_head_dim 0)"),
    # Megatron's linear-attention sizes (Gated DeltaNet's names); glm5_next's KDA has one head count and one
    # head dim for q, k and v
    "--linear-num-key-heads": (int, lambda c: c.get("linear_num_key_heads", c.get("linear_num_heads")),
                               "linear_num_key_heads/linear_num_heads"),
    "--linear-num-value-heads": (int, lambda c: c.get("linear_num_value_heads", c.get("linear_num_heads")),
                                 "linear_num_value_heads/linear_num_heads"),
    "--linear-key-head-dim": (int, lambda c: c.get("linear_key_head_dim", c.get("linear_head_dim")),
                              "linear_key_head_dim/linear_head_dim"),
    "--linear-value-head-dim": (int, lambda c: c.get("linear_value_head_dim", c.get("linear_head_dim")),
                                "linear_value_head_dim/linear_head_dim"),
    "--linear-conv-kernel-dim": (int, lambda c: c.get("linear_conv_kernel_dim"), "linear_conv_kernel_dim"),
}
# switches compared both ways (absent = Megatron's default) once any architecture flag is given
SWITCHES: dict[str, tuple[Getter, str]] = {
    "--swiglu": (lambda c: c.get("hidden_act", "silu") == "silu", "hidden_act=silu"),
    "--untie-embeddings-and-output-weights": (lambda c: not c.get("tie_word_embeddings", False),
                                              "tie_word_embeddings=false"),
    "--multi-latent-attention": (_mla, "MLA (kv_lora_rank)"),
    "--qk-layernorm": (_qk_norm, "q/k norms"),
    "--add-qkv-bias": (_qkv_bias, "attention_bias"),
    "--group-query-attention": (lambda c: None if _mla(c) else
                                c.get("num_key_value_heads", c.get("num_attention_heads")) != c.get("num_attention_heads"),
                                "num_key_value_heads < num_attention_heads"),
    "--post-self-attn-layernorm": (lambda c: c.get("model_type") in POST_NORMED, "post_self_attn_layernorm (glm4)"),
    "--post-mlp-layernorm": (lambda c: c.get("model_type") in POST_NORMED, "post_mlp_layernorm (glm4)"),
    # GQA rotary pairs; MLA checkpoints' rope layout is converted by the loader, so the flag is not compared there
    "--rotary-interleaved": (lambda c: None if _mla(c) else c.get("model_type") == "glm4", "interleaved rotary (glm4)"),
    # Megatron's Llama-3.x rope scaling (low/high-frequency bands, original context); the factor is --rotary-scaling-factor
    "--use-rope-scaling": (lambda c: None if _mla(c) else _rope_type(c) == "llama3", "rope_scaling rope_type llama3"),
    "--moe-router-enable-expert-bias": (lambda c: None if not _num_experts(c) else
                                        c.get("model_type") not in SOFTMAX_ROUTED, "e_score_correction_bias"),
    # Megatron's names (attention_output_gate, layernorm_zero_centered_gamma, moe_shared_expert_gate) and the
    # older --use-gated-attention of upstream's Megatron fork, which means the same output gate
    "--attention-output-gate": (lambda c: c.get("model_type") in HYBRID_QWEN, "gated attention (qwen3_next, qwen3_5)"),
    "--use-gated-attention": (lambda c: c.get("model_type") in HYBRID_QWEN, "gated attention (qwen3_next, qwen3_5)"),
    "--apply-layernorm-1p": (lambda c: c.get("model_type") in HYBRID_QWEN, "zero-centred RMSNorm weights (1 + w)"),
    "--moe-shared-expert-gate": (lambda c: None if not _num_experts(c) else c.get("model_type") in SHARED_EXPERT_GATED,
                                 "shared_expert_gate"),
}
# accepted, no config.json counterpart (or implied by the family): rope flags and the bias switch
PLAIN_SWITCHES = ("--disable-bias-linear", "--use-rotary-position-embeddings", "--no-position-embedding",
                  "--moe-router-pre-softmax")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model (Megatron MODEL_ARGS)",
        "The architecture comes from --hf-checkpoint's config.json; these flags are checked against it.")
    for flag, (typ, _, key) in VALUE_FLAGS.items():
        _add(g, parser, flag, type=typ, default=None, help=f"must equal config.json's {key}")
    _add(g, parser, "--moe-layer-freq", type=str, default=None,
         help="MoE layer pattern, e.g. '[0]*3+[1]*75'; must match config.json's dense/MoE layers")
    _add(g, parser, "--linear-attention-freq", type=str, default=None,
         help="Megatron's linear/softmax attention pattern: N (every N-th layer softmax attention) or a list "
              "expression of 1 (linear) and 0 (softmax) per layer; must match config.json's layer_types "
              "(without --spec, leaving it out means no linear-attention layers)")
    _add(g, parser, "--activation-func-clamp-value", type=float, default=None,
         help="Megatron's clamped SwiGLU (gate <= v, -v <= up <= v); must equal config.json's swiglu_limit, "
              "and is required when the config states one")
    for flag, (_, meaning) in SWITCHES.items():
        _add(g, parser, flag, action="store_true", default=None, help=f"must agree with config.json ({meaning})")
    for flag in PLAIN_SWITCHES:
        _add(g, parser, flag, action="store_true", default=None, help="accepted (implied by the model family)")
    _add(g, parser, "--model-name", type=str, default=None,
         help="upstream picks its Megatron->HF weight converter by this name (default: the config class's); here "
              "config.json's model_type picks the model family, and a --model-name naming another family is an error")


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def model_args_given(args: argparse.Namespace) -> bool:
    flags = list(VALUE_FLAGS) + ["--moe-layer-freq", "--linear-attention-freq", "--activation-func-clamp-value"]
    return any(getattr(args, _dest(f), None) is not None for f in flags)


def text_model_config(cfg: dict) -> dict:
    """A vision-language config.json (Qwen3.5: `text_config`) read as its text model's, which MODEL_ARGS describe."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    return text | {k: v for k, v in cfg.items() if k in ("tie_word_embeddings", "model_type")}


def model_arg_mismatches(args: argparse.Namespace, cfg: dict) -> list[str]:
    """One line per MODEL_ARGS flag that disagrees with config.json: 'FLAG VALUE: config.json says ...'."""
    out: list[str] = []
    cfg = text_model_config(cfg)
    if args.model_name is not None:
        out += _model_name_mismatch(args.model_name, cfg)
    for flag, (typ, get, key) in VALUE_FLAGS.items():
        mine = getattr(args, _dest(flag), None)
        if mine is None:
            continue
        have = get(cfg)
        if have is not None and not _same(typ(have), mine):
            out.append(f"{flag} {mine}: config.json says {key}={have}")
    if args.moe_layer_freq is not None:
        want = moe_layer_pattern(cfg)
        mine = parse_layer_freq(args.moe_layer_freq, args.num_layers or cfg.get("num_hidden_layers"))
        if want is None:
            out.append(f"--moe-layer-freq {args.moe_layer_freq}: config.json describes a dense model (no experts)")
        elif mine != want:
            out.append(f"--moe-layer-freq {args.moe_layer_freq}: config.json has {want.count(0)} dense and "
                       f"{want.count(1)} MoE layers in the pattern {_pattern_text(want)}")
    out += _linear_attention_mismatches(args, cfg) + _clamp_mismatches(args, cfg)
    if model_args_given(args):
        for flag, (get, meaning) in SWITCHES.items():
            have = get(cfg)
            mine = bool(getattr(args, _dest(flag), None))
            if have is not None and bool(have) != mine:
                out.append(f"{flag} {'given' if mine else 'absent'}: config.json says "
                           f"{'' if have else 'not '}{meaning}")
    return out


def _linear_attention_mismatches(args: argparse.Namespace, cfg: dict) -> list[str]:
    """--linear-attention-freq against layer_types, both ways. Without it Megatron builds softmax attention in
    every layer, unless a --spec builds the layers: upstream's Qwen3-Next / Qwen3.5 MODEL_ARGS leave the pattern
    out and their run scripts pass such a --spec, so those families may leave it out."""
    want, given = linear_attention_pattern(cfg), args.linear_attention_freq
    if given is None:
        if want is None or not model_args_given(args) or args.spec or cfg.get("model_type") in HYBRID_QWEN:
            return []
        return [f"--linear-attention-freq absent: config.json's layer_types have {want.count(1)} linear-attention "
                f"layers; add --linear-attention-freq {_linear_freq_text(want)}"]
    mine = parse_linear_attention_freq(given, args.num_layers or cfg.get("num_hidden_layers"))
    if want is None:
        return [f"--linear-attention-freq {given}: config.json has no linear-attention layers (layer_types)"]
    if mine != want:
        return [f"--linear-attention-freq {given}: config.json's layer_types have {want.count(1)} linear-attention "
                f"and {want.count(0)} softmax-attention layers, i.e. --linear-attention-freq {_linear_freq_text(want)}"]
    return []


def _linear_freq_text(pattern: list[int]) -> str:
    """The shortest --linear-attention-freq value giving the pattern: N where it is periodic, else the list."""
    for n in range(1, len(pattern) + 1):
        if pattern == [int((i + 1) % n != 0) for i in range(len(pattern))]:
            return str(n)
    return f"'{_pattern_text(pattern)}'"


def _clamp_mismatches(args: argparse.Namespace, cfg: dict) -> list[str]:
    """--activation-func-clamp-value against swiglu_limit, both ways (absent: Megatron's SwiGLU is unclamped)."""
    want, given = cfg.get("swiglu_limit"), args.activation_func_clamp_value
    if given is None:
        if want is None or not model_args_given(args):
            return []
        return [f"--activation-func-clamp-value absent: config.json says swiglu_limit={want}; "
                f"add --activation-func-clamp-value {want:g}"]
    if want is None:
        return [f"--activation-func-clamp-value {given:g}: config.json has no swiglu_limit (an unclamped SwiGLU)"]
    if not _same(float(want), given):
        return [f"--activation-func-clamp-value {given:g}: config.json says swiglu_limit={want}"]
    return []


def _model_name_mismatch(name: str, cfg: dict) -> list[str]:
    """--model-name names a family by substring, as upstream's converter dispatch reads it ('minimax_m2',
    'qwen2.5'); it must name the family that serves config.json's model_type, or no registered family."""
    from slime_plugins.models.registry import families

    def norm(text: str) -> str:
        return text.lower().replace("_", "").replace("-", "").replace(".", "")

    model_type = str(cfg.get("model_type", ""))
    named = [f for f in families() if any(norm(t) in norm(name) for t in (f.name, *f.model_types))]
    if not named or any(model_type in f.model_types for f in named):
        return []
    return [f"--model-name {name}: names the {named[0].name} model family, but config.json's model_type is "
            f"{model_type!r}; drop --model-name or point --hf-checkpoint at a {named[0].name} checkpoint"]


def _pattern_text(pattern: list[int]) -> str:
    runs: list[tuple[int, int]] = []
    for v in pattern:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return "+".join(f"[{v}]*{n}" for v, n in runs)
