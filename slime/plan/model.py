"""Model shapes for the planner: an HF config (dict, config.json path or registry name) -> parameter counts.

Counts follow the transformers modules of the GLM-5 family (`glm_moe_dsa`: MLA + DSA indexer + MoE;
`glm4_moe_lite`: MLA + MoE; `glm5_next`: KDA + NoPE MLA with a k-pool indexer, mHC streams, a vision
tower: slime/plan/hybrid.py), parameter by parameter, so a loaded checkpoint's parameter bytes
equal `ModelShape.hf_param_count() * bytes` exactly (tests check this on the tiny model).
Pure Python: no torch import, so the planner and `--dry-run` start fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from slime.plan.hybrid import HYBRID_MODEL_TYPES, hybrid_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "scripts" / "models" / "configs"
SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "glm4_moe_lite", "deepseek_v3", "kimi_k2",  # kimi_k2: DeepSeek-V3 shape
                         *HYBRID_MODEL_TYPES)


def _tiny(model_type: str) -> dict[str, Any]:
    from slime_plugins.models.glm5.tiny import TINY_CONFIGS

    return dict(TINY_CONFIGS[model_type])


# Registry names that are not a json file under scripts/models/configs/.
BUILTIN_CONFIGS = {
    "glm5-tiny": lambda: _tiny("glm_moe_dsa"),
    "glm4.7-flash-tiny": lambda: _tiny("glm4_moe_lite"),
}
# Names kept for what they used to call: GLM-5.3-Flash's registry entry was "glm5.3-flash-300B".
ALIASES = {"glm5.3-flash-300B": "glm5.3-flash"}


def registry_names() -> list[str]:
    files = sorted(p.stem for p in CONFIG_DIR.glob("*.json")) if CONFIG_DIR.is_dir() else []
    return sorted(set(files) | set(BUILTIN_CONFIGS) | set(ALIASES))


def load_config(spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, HF config dict) from a dict, a config.json path, a checkpoint dir or a registry name."""
    if isinstance(spec, dict):
        return str(spec.get("_name", spec.get("model_type", "model"))), dict(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        with open(path) as f:
            return path.parent.name if path.name == "config.json" else path.stem, json.load(f)
    if spec in BUILTIN_CONFIGS:
        return spec, BUILTIN_CONFIGS[spec]()
    spec = ALIASES.get(spec, spec)
    registry_file = CONFIG_DIR / f"{spec}.json"
    if registry_file.is_file():
        with open(registry_file) as f:
            return spec, json.load(f)
    raise ValueError(
        f"model config {spec!r} is neither a config.json path, a checkpoint dir nor a registry name; "
        f"known names: {', '.join(registry_names())}"
    )


def _indexer_layer_count(cfg: dict[str, Any], n_layers: int) -> int:
    """Layers that run their own DSA indexer ("full"); "shared" layers reuse the previous top-k."""
    if cfg.get("model_type") != "glm_moe_dsa":
        return 0
    types = cfg.get("indexer_types")
    if types is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:  # transformers' default schedule: every layer from the offset on, every `freq` layers
            freq = max(int(cfg.get("index_topk_freq", 1)), 1)
            offset = int(cfg.get("index_skip_topk_offset", 2))
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
    return sum(1 for t in types[:n_layers] if t == "full")


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dense_layers: int  # first_k_dense_replace
    intermediate_size: int  # dense MLP
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    num_heads: int
    q_lora_rank: int  # 0 = plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_layers: int = 0
    mtp_layers: int = 0  # num_nextn_predict_layers (not built by transformers; MODEL_ARGS --mtp-num-layers)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Hybrid stacks (glm5_next). Layers not in linear_layer_ids are MLA.
    linear_layer_ids: tuple[int, ...] = ()  # KDA layers: a recurrent state per sequence instead of a KV cache
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel: int = 0
    indexer_layer_ids: tuple[int, ...] | None = None  # layers running their own indexer, where the config says
    index_kpool: int = 0  # > 0: the indexer scores k-pool compressed keys (one per index_kpool tokens)
    hc_mult: int = 1  # mHC residual streams (1: a plain residual)
    vision_params: int = 0  # vision tower: frozen in text RL, replicated on every engine device

    @classmethod
    def from_config(cls, spec: str | dict[str, Any]) -> "ModelShape":
        name, c = load_config(spec)
        mt = c.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} ({name}) is not supported by the planner; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if mt in HYBRID_MODEL_TYPES:
            fields = hybrid_fields(c)
            return cls(name=name, indexer_layers=len(fields["indexer_layer_ids"]), **fields)
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok") if k not in c]
        if missing:
            raise ValueError(f"model config {name}: missing keys {', '.join(missing)}; add them to its config.json")
        n = int(c["num_hidden_layers"])
        dsa = mt == "glm_moe_dsa"
        return cls(
            name=name, model_type=mt, vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            num_layers=n, dense_layers=min(int(c.get("first_k_dense_replace", 0)), n),
            intermediate_size=int(c.get("intermediate_size", 0)),
            moe_intermediate_size=int(c["moe_intermediate_size"]), n_routed_experts=int(c["n_routed_experts"]),
            n_shared_experts=int(c.get("n_shared_experts", 0) or 0), top_k=int(c["num_experts_per_tok"]),
            num_heads=int(c["num_attention_heads"]), q_lora_rank=int(c.get("q_lora_rank") or 0),
            kv_lora_rank=int(c["kv_lora_rank"]), qk_nope_head_dim=int(c["qk_nope_head_dim"]),
            qk_rope_head_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
            index_n_heads=int(c.get("index_n_heads", 32)) if dsa else 0,
            index_head_dim=int(c.get("index_head_dim", 128)) if dsa else 0,
            index_topk=int(c.get("index_topk", 2048)) if dsa else 0,
            indexer_layers=_indexer_layer_count(c, n),
            mtp_layers=int(c.get("num_nextn_predict_layers", 0) or 0),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)),
        )

    # --- derived sizes ----------------------------------------------------------------------
    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_layers(self) -> int:
        return self.num_layers - len(self.linear_layer_ids)

    def is_linear(self, layer: int) -> bool:
        return layer in self.linear_layer_ids

    def indexers_in(self, layers: range) -> int:
        """Layers of `layers` that run their own indexer; spread evenly where the config names none."""
        if self.indexer_layer_ids is not None:
            return sum(1 for i in self.indexer_layer_ids if i in layers)
        return round(self.indexer_layers * len(layers) / self.num_layers)

    # --- per-layer parameter counts, split by how tensor parallelism shards them -----------
    def attention_params(self) -> tuple[int, int]:
        """(tp-sharded, replicated) parameters of one MLA attention block, norms of the layer included.

        Sharded: q_b (or q_proj), kv_b, o_proj. Replicated: the low-rank down projections and their
        norms, the two layer norms, biases of down projections and o_proj, the layer's mHC mixers.
        """
        h, H = self.hidden_size, self.num_heads
        if self.q_lora_rank:
            q_sharded = self.q_lora_rank * H * self.qk_head_dim
            q_rep = h * self.q_lora_rank + self.q_lora_rank  # q_a_proj + q_a_layernorm
        else:
            q_sharded, q_rep = h * H * self.qk_head_dim, 0
        kv_rep = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # kv_a_proj + norm
        sharded = q_sharded + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * h
        bias = 0
        if self.attention_bias:  # q_a, kv_a and o_proj carry biases (q_b, kv_b never do)
            bias = (self.q_lora_rank if self.q_lora_rank else 0) + self.kv_lora_rank + self.qk_rope_head_dim + h
        return sharded, q_rep + kv_rep + bias + 2 * h + self.mhc_params()

    def linear_attention_params(self) -> tuple[int, int]:
        """(tp-sharded, replicated) parameters of one KDA block, norms and mHC mixers of the layer included.

        Sharded by head: q/k/v projections and their depthwise convs, dt_bias, A_log, the forget-gate and
        output-gate up projections (f_b, g_b), beta (b_proj), o_proj. Replicated: the rank-d down projections
        f_a and g_a, the gated output norm (one head's width), the two layer norms."""
        h, H, d, K = self.hidden_size, self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel
        sharded = 3 * h * H * d + 3 * H * d * K + H * d + H + 2 * d * H * d + h * H + H * d * h
        return sharded, 2 * h * d + d + 2 * h + self.mhc_params()

    def mhc_params(self) -> int:
        """mHC mixers of one layer (attention and MLP): fn [(2 + m) m, m h], base [(2 + m) m], scale [3]."""
        m = self.hc_mult
        if m <= 1:
            return 0
        mix = (2 + m) * m
        return 2 * (mix * m * self.hidden_size + mix + 3)

    def layer_attention_params(self, layer: int) -> tuple[int, int]:
        return self.linear_attention_params() if self.is_linear(layer) else self.attention_params()

    def attention_totals(self, layers: Iterable[int]) -> tuple[int, int]:
        """(tp-sharded, replicated) attention parameters of `layers` (norms and mHC included)."""
        sharded = replicated = 0
        for i in layers:
            s, r = self.layer_attention_params(i)
            sharded, replicated = sharded + s, replicated + r
        return sharded, replicated

    def indexer_params(self) -> int:
        """One DSA indexer: wq_b, wk, k_norm (LayerNorm: weight + bias), weights_proj; with k-pool compression its
        positional term [kpool, d] and gate [d, h]. Replicated."""
        if not self.index_n_heads:
            return 0
        d, nh, h = self.index_head_dim, self.index_n_heads, self.hidden_size
        q_in = self.q_lora_rank or h
        kpool = self.index_kpool * d + d * h if self.index_kpool else 0
        return q_in * nh * d + h * d + 2 * d + h * nh + kpool

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * self.n_shared_experts

    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.n_routed_experts * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def mtp_extra_params(self) -> int:
        """Per MTP layer, on top of one MoE decoder layer: enorm, hnorm, eh_proj [h, 2h], final norm."""
        h = self.hidden_size
        return 3 * h + 2 * h * h

    # --- totals -------------------------------------------------------------------------------
    def decoder_layer_params(self, moe: bool, indexer: bool) -> int:
        """One MLA decoder layer (the MTP layers are MLA in every supported family)."""
        sharded, rep = self.attention_params()
        mlp = (self.router_params() + self.shared_expert_params() + self.n_routed_experts * self.expert_params()
               if moe else self.dense_mlp_params())
        return sharded + rep + (self.indexer_params() if indexer else 0) + mlp

    def hf_param_count(self) -> int:
        """Parameters transformers builds (no MTP layers; buffers such as e_score_correction_bias excluded)."""
        total = self.embedding_params() + self.head_params() + self.hidden_size  # final norm
        total += sum(self.attention_totals(range(self.num_layers))) + self.indexer_layers * self.indexer_params()
        total += self.dense_layers * self.dense_mlp_params()
        total += self.moe_layers * (self.router_params() + self.shared_expert_params()
                                    + self.n_routed_experts * self.expert_params())
        return total + self.vision_params

    def mtp_param_count(self) -> int:
        """MTP layers (an MoE decoder layer with its own indexer each, plus projections); embeddings shared."""
        per = self.decoder_layer_params(moe=True, indexer=self.index_n_heads > 0) + self.mtp_extra_params()
        return self.mtp_layers * per

    def total_param_count(self, with_mtp: bool = True) -> int:
        return self.hf_param_count() + (self.mtp_param_count() if with_mtp else 0)

    def active_param_count(self, with_embeddings: bool = False) -> int:
        """Parameters one token of text passes through (top_k routed experts + shared), per forward."""
        attn = sum(self.attention_totals(range(self.num_layers))) + self.indexer_layers * self.indexer_params()
        mlp = self.dense_layers * self.dense_mlp_params() + self.moe_layers * (
            self.router_params() + self.shared_expert_params() + self.top_k * self.expert_params())
        emb = self.embedding_params() + self.head_params() if with_embeddings else self.head_params()
        return attn + mlp + emb + self.hidden_size

    def kv_cache_bytes_per_token(self, kv_bytes: float = 2.0, index_bytes: float | None = None) -> float:
        """Rollout-engine cache per token, all layers: MLA latent (kv_lora_rank + qk_rope_head_dim) per MLA
        layer, plus the DSA indexer key (index_head_dim) on layers that run an indexer, one per index_kpool
        tokens where the indexer scores k-pool compressed keys. KDA layers keep no per-token cache
        (linear_state_bytes_per_sequence)."""
        index_bytes = kv_bytes if index_bytes is None else index_bytes
        mla = self.mla_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes
        index_key = self.index_head_dim * index_bytes / max(self.index_kpool, 1)
        return mla + self.indexer_layers * index_key

    def linear_state_bytes_per_sequence(self, state_bytes: float = 4.0, conv_bytes: float = 2.0) -> float:
        """Engine cache of one running sequence on the KDA layers, whatever its length: the recurrent state
        (heads x d x d, fp32 as SGLang keeps it by default) and the q/k/v conv windows (kernel - 1 tokens)."""
        H, d, K = self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel
        per_layer = H * d * d * state_bytes + 3 * H * d * max(K - 1, 0) * conv_bytes
        return len(self.linear_layer_ids) * per_layer

    def describe(self) -> str:
        hybrid = (f" ({len(self.linear_layer_ids)} KDA + {self.mla_layers} MLA/DSA, {self.hc_mult} mHC streams, "
                  f"vision {self.vision_params / 1e9:.2f}B)" if self.linear_layer_ids else "")
        return (f"{self.name} ({self.model_type}): {self.total_param_count(False) / 1e9:.1f}B params "
                f"(+{self.mtp_param_count() / 1e9:.2f}B MTP), {self.active_param_count(True) / 1e9:.1f}B active, "
                f"{self.num_layers} layers{hybrid}, hidden {self.hidden_size}, {self.n_routed_experts} experts top-{self.top_k}")

