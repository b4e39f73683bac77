"""The planner on GLM-5.3-Flash (glm5_next): parameter counts equal transformers' (meta device), the registry
config is transformers' defaults plus the checkpoint's additions, the engine's KDA state / NoPE MLA / k-pool
indexer caches and mHC's streams hand-computed, the family's config reader agrees on the layer schedule, and
the devices needed on H200, Ascend 950PR and 950DT at the run script's sequence lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.plan import Layout, ModelShape, TrainSettings, get_device, plan
from slime.plan.__main__ import main as plan_main
from slime.plan.memory import layer_activation_elements, stage_params

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "scripts/models/configs/glm5.3-flash.json"


def _meta_count(model_cls, config) -> int:
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def test_published_config_counts_equal_transformers_meta_build():
    """Exact, parameter for parameter: Glm5NextForConditionalGeneration(Glm5NextConfig()) on the meta device
    holds 313,786,889,214 parameters (313.8B; 17.4B active per token: text without 280 of 288 experts)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config = Glm5NextConfig()
    shape = ModelShape.from_config(config.to_dict())
    assert shape.hf_param_count() == _meta_count(Glm5NextForConditionalGeneration, config) == 313_786_889_214
    unused_experts = shape.moe_layers * (shape.n_routed_experts - shape.top_k) * shape.expert_params()
    assert shape.active_param_count(with_embeddings=True) == shape.hf_param_count() - shape.vision_params - unused_experts
    assert round(shape.active_param_count(with_embeddings=True) / 1e9, 1) == 17.4
    assert (len(shape.linear_layer_ids), shape.mla_layers, shape.indexer_layers, shape.dense_layers) == (34, 11, 11, 3)
    assert round(shape.vision_params / 1e9, 2) == 0.46


@pytest.mark.parametrize("flat", [False, True], ids=["multimodal", "text-only"])
def test_tiny_counts_equal_transformers(flat):
    """The tests' tiny configs: a 'shared' DSA layer (no indexer of its own), a one-block vision tower, and the
    flat text-only checkpoint (no vision; text model + lm_head)."""
    from transformers import Glm5NextForConditionalGeneration, Glm5NextTextModel

    from slime_plugins.models.glm5_next.tiny import tiny_config

    config = tiny_config("glm5_next_text" if flat else "glm5_next")
    shape = ModelShape.from_config(config.to_dict())
    if flat:
        expected = _meta_count(Glm5NextTextModel, config) + config.vocab_size * config.hidden_size
        assert shape.vision_params == 0
    else:
        expected = _meta_count(Glm5NextForConditionalGeneration, config)
        assert shape.vision_params > 0
    assert shape.indexer_layer_ids == (2,) and shape.linear_layer_ids == (0, 1, 4)
    assert shape.hf_param_count() == expected


def test_registry_config_is_transformers_defaults_plus_the_checkpoints_additions():
    from transformers import Glm5NextConfig

    registry = json.loads(REGISTRY.read_text())
    registry.pop("_comment")
    expected = json.loads(json.dumps(Glm5NextConfig().to_dict()))  # as config.json stores it (string keys)
    expected |= {"architectures": ["Glm5NextForConditionalGeneration"], "dtype": "bfloat16"}
    expected["text_config"] |= {"num_nextn_predict_layers": 1, "mhc": True, "dtype": "bfloat16"}
    assert registry == expected
    shape = ModelShape.from_config("glm5.3-flash")
    assert shape.mtp_layers == 1 and ModelShape.from_config("glm5.3-flash-300B") == shape  # the old name


def test_family_config_reader_agrees_with_the_planner():
    """slime_plugins.models.glm5_next.config (the trainer's reader) and the planner see the same schedule."""
    from slime_plugins.models.glm5_next.config import from_hf

    for cfg in (json.loads(REGISTRY.read_text()), {**json.loads(REGISTRY.read_text())["text_config"],
                                                   "model_type": "glm5_next_text"}):
        arch, shape = from_hf(cfg), ModelShape.from_config(cfg)
        n = arch.num_hidden_layers
        assert tuple(i for i in range(n) if arch.is_linear(i)) == shape.linear_layer_ids
        assert tuple(i for i in range(n) if arch.indexer_type(i) == "full") == shape.indexer_layer_ids
        assert arch.mlp_layer_types.count("dense") == shape.dense_layers
        assert (arch.mtp_num_layers, arch.hc_mult, arch.index_kpool) == (shape.mtp_layers, shape.hc_mult,
                                                                          shape.index_kpool)


def test_engine_caches_hand_computed():
    """Per token: the NoPE MLA latent (512) on 11 layers + the indexer key (128) per 16-token k-pool on 11
    layers. Per sequence: the KDA state 64 x 128 x 128 fp32 and the q/k/v conv windows (3 tokens) on 34 layers."""
    shape = ModelShape.from_config("glm5.3-flash")
    assert shape.kv_cache_bytes_per_token(2.0) == 11 * 512 * 2 + 11 * 128 * 2 / 16
    assert shape.linear_state_bytes_per_sequence() == 34 * (64 * 128 * 128 * 4 + 3 * 8192 * 3 * 2)
    p = plan(shape, Layout(4, 8, tp=8, pp=4, ep=8), get_device("h200"))
    e = p.engine
    assert e.state_bytes_per_sequence == shape.linear_state_bytes_per_sequence() / 8
    assert e.kv_tokens == pytest.approx(e.kv_pool / (shape.kv_cache_bytes_per_token(2.0)
                                                     + e.state_bytes_per_sequence / (2048 + 8192)))


def test_mhc_streams_and_kda_in_activations_and_stage_params():
    shape = ModelShape.from_config("glm5.3-flash")
    lay, ts = Layout(1, 8, tp=8), TrainSettings(recompute="none")
    kda = layer_activation_elements(shape, lay, ts, moe=True, indexer=False, linear=True)
    mla = layer_activation_elements(shape, lay, ts, moe=True, indexer=False)
    assert kda != mla
    plain = ModelShape(**{**shape.__dict__, "hc_mult": 1})
    # mHC: two blocks, 4 streams read in fp32 (2 units) and written back, sequence-split over tp 8
    assert mla - layer_activation_elements(plain, lay, ts, moe=True, indexer=False) == 2 * 3 * 4 * 4096 / 8
    full = TrainSettings(recompute="full", max_tokens_per_gpu=4096)
    sp1 = stage_params(shape, 1, 0, with_mtp=False)
    assert (sp1.linear_layers, sp1.indexer_layers, sp1.frozen) == (34, 11, shape.vision_params)
    m = plan(shape, Layout(4, 8, tp=8, pp=4, ep=8), get_device("h200"), full).stages[0]
    m_plain = plan(plain, Layout(4, 8, tp=8, pp=4, ep=8), get_device("h200"), full).stages[0]
    assert m.activations > m_plain.activations  # recompute keeps each layer's 4 streams, not one hidden state
    # the frozen vision tower has weights on the first stage but no grads
    assert m.weights / 2 - m.grads / 4 == pytest.approx(shape.vision_params)


def test_devices_needed_on_h200_950pr_950dt(capsys):
    """`--fewest` at the run script's lengths (2048-token prompts, 8192-token responses, 64 x 8 samples,
    global batch 512), as the trainer runs (no MTP, optimizer state in host memory)."""
    assert plan_main(["--model", "glm5.3-flash", "--fewest", "h200,950pr,950dt", "--max-nodes", "8",
                      "--search-pp", "1,2", "--no-mtp", "--max-tokens-per-gpu", "4096", "--optimizer-cpu-offload",
                      "--rollout-max-response-len", "8192", "--global-batch-size", "512"]) == 0
    out = capsys.readouterr().out
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in out.splitlines() if r.startswith("| ")
            and not r.startswith("| device")}
    assert set(rows) == {"h200", "950pr", "950dt"}
    devices = {k: int(v.split("=")[1]) for k, v in rows.items()}
    assert all(16 <= n <= 64 for n in devices.values()), devices
    assert devices["950pr"] >= devices["950dt"]  # 112 GB per device against 144
