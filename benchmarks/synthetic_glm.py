"""A GLM-5-shaped (glm_moe_dsa) model of a chosen size for weight-sync benchmarks, and a server for it.

`model_spec(target_mb)` picks the layer count so the model holds at least `target_mb` of weights; the
weights are bfloat16 except embeddings, lm_head, norms, the MoE router and its bias, which are float32
(the trainer exports the router and bias in float32; the large float32 tables give the mix a real
share of both dtypes). Experts are named per expert (`experts.E.gate_proj.weight`), as trainers and
checkpoints name them; the engine writes them into its fused expert tensors.

    python benchmarks/synthetic_glm.py --spec '<json of model_spec()>'    # serve it (token in $SLIME_ENGINE_TOKEN)

prints `URL http://127.0.0.1:PORT` once the real embedded engine (slime.backends.embedded) listens.
The served weights are zeros (memory touched, so updates do not pay first-touch page faults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

# Shapes of a small-but-real MoE layer: 2048 hidden, 32 experts of 512, MLA ranks as in GLM-5 ratios.
BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=16384, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, index_n_heads=8, index_head_dim=64, index_topk=256,
    first_k_dense_replace=1, max_position_embeddings=4096,
)
FLOAT32_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layernorm.weight", "k_norm.weight",
                    "k_norm.bias", "mlp.gate.weight", "e_score_correction_bias")


def keeps_float32(name: str) -> bool:
    return name.endswith(FLOAT32_SUFFIXES)


def build_model(spec: dict[str, Any], device: str = "meta") -> torch.nn.Module:
    """The transformers model of `spec`; on "meta" (shapes only) or materialized as zeros on `device`."""
    from transformers import AutoModelForCausalLM

    from slime_plugins.models.glm5.tiny import tiny_config

    config = tiny_config("glm_moe_dsa", **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device != "meta":
        model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            dtype = p.dtype
            if p.dtype.is_floating_point and "rotary_emb" not in name:
                dtype = torch.float32 if keeps_float32(name) else torch.bfloat16
            if dtype != p.dtype:
                p.data = p.data.to(dtype) if device == "meta" else torch.empty(p.shape, dtype=dtype, device=device)
            if device != "meta":
                p.data.zero_()
    return model


def named_specs(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF checkpoint name, shape, dtype) of every weight the engine accepts, in checkpoint order."""
    from slime.backends.embedded.weights import WeightNameMap

    name_map = WeightNameMap(model)
    out = []
    for name in name_map.checkpoint_names():
        t = name_map.resolve(name)
        out.append((name, tuple(t.shape), t.dtype))
    return out


def model_spec(target_mb: float) -> dict[str, Any]:
    """BASE_CONFIG with enough layers for `target_mb` MiB of weights (at least 2: one dense, one MoE)."""
    def size_mb(layers: int) -> float:
        specs = named_specs(build_model(BASE_CONFIG | {"num_hidden_layers": layers}))
        return sum(torch.Size(s).numel() * d.itemsize for _, s, d in specs) / 2**20

    one, two = size_mb(2), size_mb(3)
    per_layer = two - one
    layers = 3 + max(0, int((target_mb - two) // per_layer) + (1 if target_mb > two else 0))
    return BASE_CONFIG | {"num_hidden_layers": max(2, layers)}


def serve(spec: dict[str, Any]) -> None:
    import signal
    import threading

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.backends.embedded.__main__ import TOKEN_ENV

    import logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("slime.backends.embedded.engine").setLevel(logging.ERROR)  # "no tokenizer": none is needed
    from slime.accelerator import get_accelerator

    model = build_model(spec, device=str(get_accelerator().device()))
    with tempfile.TemporaryDirectory() as empty:  # no tokenizer: the benchmark sends no text
        engine = EmbeddedEngine(EngineConfig(model_path=empty), model=model)
    server = EngineHTTPServer(engine, os.environ[TOKEN_ENV], 0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start_in_thread()
    print(f"URL {server.url}", flush=True)
    stop.wait()
    server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="Serve a synthetic GLM-5-shaped model with the embedded engine.")
    ap.add_argument("--spec", required=True, help="JSON config overrides (from model_spec)")
    serve(json.loads(ap.parse_args().spec))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
