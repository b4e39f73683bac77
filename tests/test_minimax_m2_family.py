"""The minimax_m2 family's own behaviour (MiniMax-M2 / M2.5: GQA with q/k RMSNorm over all heads at once, partial
rotary, a sigmoid-routed MoE with expert bias in every layer, checkpoint names `block_sparse_moe.experts.{e}.w1|w3|w2`):
the published config (scripts/models/configs/minimax-m2.json: rotary_dim 64 of 128) reads as transformers does, and
per-head q/k norms are refused in one line. Logits and grads against transformers' MiniMaxM2ForCausalLM, the HF round
trip, engine log-probs and the dp2 / tp2 (the full-width norms gather q / k over TP) / ep2 / cp2 / pp2 layouts are
tests/test_model_conformance.py's minimax_m2 case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_published_config_reads_as_transformers_does():
    from transformers import AutoConfig

    from slime_plugins.models.registry import UnsupportedModelError, parse_hf_config

    cfg = json.loads((ROOT / "scripts/models/configs/minimax-m2.json").read_text())
    family, arch = parse_hf_config(cfg)
    hf = AutoConfig.for_model("minimax_m2", **{k: v for k, v in cfg.items() if k != "model_type"})
    assert family.name == "minimax_m2" and arch.rotary_dim == 64 == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert (arch.n_routed_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (256, 8, 1536)
    assert arch.mlp_layer_types == ("sparse",) * 62 and arch.router == "sigmoid" and arch.n_shared_experts == 0
    assert not arch.qk_norm  # the family's attention norms q and k over all heads, not the shared per-head norm
    with pytest.raises(UnsupportedModelError, match="qk_norm_type='per_head'"):
        parse_hf_config(cfg | {"qk_norm_type": "per_head"})
