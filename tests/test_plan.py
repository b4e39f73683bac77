"""Planner formulas vs hand-computed small cases, transformers' own parameter counts, published model sizes,
and memory measured on the tiny model (CPU)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from slime.plan import DEVICES, Layout, ModelShape, RolloutSettings, TrainSettings, get_device, plan, search
from slime.plan.__main__ import main as plan_main
from slime.plan.memory import activation_bytes, layer_activation_elements, stage_params, train_memory

ROOT = Path(__file__).resolve().parents[1]

# A model small enough to count by hand (see the comments in the tests).
MINI = dict(model_type="glm_moe_dsa", vocab_size=10, hidden_size=4, num_hidden_layers=2, first_k_dense_replace=1,
            intermediate_size=6, moe_intermediate_size=2, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=3, kv_lora_rank=2,
            qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2, index_n_heads=1, index_head_dim=2, index_topk=4)


@pytest.fixture(scope="module")
def mini() -> ModelShape:
    return ModelShape.from_config(MINI)


def test_param_count_hand_computed(mini):
    # attention: q_a 4*3 + q_a_norm 3 + q_b 3*2*4 + kv_a 4*4 + kv_norm 2 + kv_b 2*2*4 + o 2*2*4 + 2 norms*4 = 97
    assert sum(mini.attention_params()) == 97
    assert mini.attention_params() == (24 + 16 + 16, 12 + 3 + 16 + 2 + 8)
    # indexer: wq_b 3*1*2 + wk 4*2 + k_norm (w+b) 2*2 + weights_proj 4*1 = 22
    assert mini.indexer_params() == 22
    # embed 40 + head 40 + norm 4 + 2 attention 194 + 2 indexers 44 + dense MLP 3*4*6 + MoE (router 16 + shared 24 + 4 experts 96)
    assert mini.hf_param_count() == 40 + 40 + 4 + 194 + 44 + 72 + 136 == 530
    # active: everything but 2 of the 4 experts and the input embedding
    assert mini.active_param_count() == 530 - 2 * 24 - 40


@pytest.mark.parametrize("name", ["glm5-744B-A40B", "glm4.7-30B-A3B", "mini"])  # glm5_next: test_plan_glm5_next.py
def test_param_count_equals_transformers(name):
    """Exact: build the model on the meta device (no memory) and count its parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "mini":
        cfg_dict = dict(MINI)
        cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
        cfg_dict["model_type"] = "glm_moe_dsa"
    else:  # the registry file is a loadable HF config.json
        cfg = AutoConfig.from_pretrained(str(ROOT / "scripts/models/configs" / f"{name}.json"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(cfg_dict if name == "mini" else name).hf_param_count() == expected


def test_published_model_sizes():
    glm5 = ModelShape.from_config("glm5-744B-A40B")
    assert abs(glm5.hf_param_count() / 744e9 - 1) < 0.01  # GLM-5: 744B total
    assert abs(glm5.active_param_count(with_embeddings=True) / 40e9 - 1) < 0.06  # ~40B active
    flash = ModelShape.from_config("glm4.7-30B-A3B")
    assert abs(flash.hf_param_count() / 30e9 - 1) < 0.02
    target = ModelShape.from_config("glm5.3-flash")  # GLM-5.3-Flash: 313.8B total, 17.4B active (meta-device count)
    assert abs(target.hf_param_count() / 313.8e9 - 1) < 0.001
    assert abs(target.active_param_count(with_embeddings=True) / 17.4e9 - 1) < 0.01


def test_kv_cache_bytes_hand_computed(mini):
    # MLA latent: 2 layers * (kv_lora 2 + rope 2) * 2 B = 16; indexer key: 2 layers * 2 * 2 B = 8
    assert mini.kv_cache_bytes_per_token(2.0) == 24
    glm5 = ModelShape.from_config("glm5-744B-A40B")
    assert glm5.kv_cache_bytes_per_token(2.0) == 78 * (512 + 64) * 2 + 78 * 128 * 2
    assert glm5.kv_cache_bytes_per_token(1.0) == 78 * 576 + 78 * 128


def test_sharded_weights_grads_optimizer_hand_computed(mini):
    lay = Layout(1, 4, tp=2, ep=2, etp=1)
    sp = stage_params(mini, 1, 0, with_mtp=False)
    # tp-split: attention (24+16+16)*2 + dense 72 + shared 24 + embed 40 + head 40; replicated: low-rank parts
    # 41*2 + router 16 + indexers 44 + final norm 4; experts 96.
    assert (sp.tp_sharded, sp.replicated, sp.expert) == (288, 146, 96)
    assert sp.per_device(lay) == 288 / 2 + 146 + 96 / 2 == 338
    ts = TrainSettings(max_tokens_per_gpu=8, with_mtp=False)
    (m,) = train_memory(mini, lay, ts, micro_batches=1)
    assert (m.weights, m.grads) == (338 * 2, 338 * 4)
    # distributed optimizer: dp = 4/2 = 2 for the 290 non-expert params, edp = 4/2 = 2 for the 48 expert ones
    assert m.optimizer == 12 * (290 / 2 + 48 / 2)
    (full,) = train_memory(mini, lay, replace(ts, distributed_optimizer=False), 1)
    assert full.optimizer == 12 * 338
    (off,) = train_memory(mini, lay, replace(ts, optimizer_cpu_offload=True), 1)
    assert off.optimizer == 0 and off.optimizer_host == m.optimizer


def test_activations_hand_computed(mini):
    lay = Layout(1, 1)
    ts = TrainSettings(max_tokens_per_gpu=8, recompute="none", with_mtp=False)
    # dense layer per token: norms 4h=16, low-rank 2*3+(2+2)+2=12, heads 2*(2*4+2+2*2+2)=32, MLP 3*6=18
    assert layer_activation_elements(mini, lay, ts, moe=False, indexer=False) == 78
    # MoE layer: 16+12+32, router 4*4, routed 2*(2*4+3*2)=28, shared 3*2+4=10; +8 with the int32 top-k indices
    assert layer_activation_elements(mini, lay, ts, moe=True, indexer=False) == 114
    assert layer_activation_elements(mini, lay, ts, moe=True, indexer=True) == 122
    sp = stage_params(mini, 1, 0, with_mtp=False)
    # (78 + 114 + 2 indexers*8) el * 8 tokens * 2 B + embedding 8*4*2 B + logits 8*10*6 B
    assert activation_bytes(mini, lay, ts, sp, micro_batches=1, stage=0) == ((78 + 114 + 16) * 16 + 64 + 480, 1)
    # full recompute: layer inputs 2*4 el/token, plus one MoE layer with its indices rebuilt (122)
    rc = replace(ts, recompute="full")
    assert activation_bytes(mini, lay, rc, sp, 1, 0)[0] == (8 + 122) * 16 + 64 + 480
    # sequence parallel over tp=2 halves the norm tensors, heads split, low-rank parts stay whole
    tp2 = Layout(1, 2, tp=2, etp=1)
    assert layer_activation_elements(mini, tp2, ts, moe=False, indexer=False) == 8 + 12 + 16 + 9


def test_pipeline_stages_and_in_flight(mini):
    lay = Layout(1, 2, pp=2)
    ts = TrainSettings(max_tokens_per_gpu=8, recompute="none", with_mtp=False)
    s0, s1 = (stage_params(mini, 2, s, with_mtp=False) for s in (0, 1))
    assert (s0.dense_layers, s0.moe_layers, s0.has_embedding, s0.has_head) == (1, 0, True, False)
    assert (s1.dense_layers, s1.moe_layers, s1.has_embedding, s1.has_head) == (0, 1, False, True)
    assert s0.tp_sharded + s0.replicated + s0.expert + s1.tp_sharded + s1.replicated + s1.expert == 530
    # 1F1B: the first stage holds pp=2 micro-batches, the last one
    assert activation_bytes(mini, lay, ts, s0, micro_batches=3, stage=0)[1] == 2
    assert activation_bytes(mini, lay, ts, s1, micro_batches=3, stage=1)[1] == 1
    assert activation_bytes(mini, lay, ts, s0, micro_batches=1, stage=0)[1] == 1


def test_step_time_lower_bound_hand_computed(mini):
    dev = replace(get_device("h200"), bf16_tflops=1e-9, hbm_tb_s=1e6)  # 1000 FLOP/s, memory effectively free
    rs = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=2, max_prompt_len=4, max_response_len=8,
                         avg_response_len=4, devices_per_engine=1, mem_fraction_static=0.5, logprob_passes=2)
    ts = TrainSettings(max_tokens_per_gpu=8, recompute="full", with_mtp=False)
    p = plan(mini, Layout(1, 1), dev, ts, rs)
    # forward per token: 2 * 442 active + attention: MLA 2*2*(4+2)*ctx 4*2 layers = 192, indexer 2*1*2*4*2 = 32
    fwd = 2 * 442 + 192 + 32
    tokens = 4 * (4 + 4)
    assert p.time.train_flops == 4 * fwd * tokens
    assert p.time.train_s == pytest.approx(4 * fwd * tokens / 1000)
    assert p.time.logprob_s == pytest.approx(2 * fwd * tokens / 1000)
    assert p.time.rollout_s == pytest.approx(fwd * tokens / 1000)
    assert p.time.bound == "compute"


def test_engine_kv_and_fit_verdicts():
    model = ModelShape.from_config("glm5.3-flash")
    dev = get_device("950dt")
    lay = Layout(16, 8, tp=4, ep=32, etp=1)
    p = plan(model, lay, dev)
    e = p.engine
    # engine weights: tp-sharded/8 + replicated per device, in bf16; the KV pool is the rest of 80%
    assert e.reserved == pytest.approx(0.8 * 144e9)
    assert e.kv_pool == pytest.approx(e.reserved - e.weights)
    # each sequence at full length (2048 + 8192) also holds its KDA recurrent state, split over the engine's 8 ranks
    assert e.state_bytes_per_sequence == pytest.approx(model.linear_state_bytes_per_sequence() / 8)
    assert e.kv_tokens == pytest.approx(e.kv_pool / (model.kv_cache_bytes_per_token(2.0)
                                                     + e.state_bytes_per_sequence / 10240))
    assert p.fits and p.peak == max(p.phases.values()) <= p.usable
    # the same run on 80 GB devices with 8-device engines cannot hold the engine's weights
    small = plan(model, lay, get_device("h100"))
    assert not small.fits and any("engine weights" in x for x in small.problems)
    with pytest.raises(ValueError, match="not divisible by etp\\*ep\\*pp=256"):
        plan(model, Layout(16, 8, tp=4, ep=64, etp=None), dev)  # expert-TP = TP: 4 * 64 > 128 devices
    assert Layout(16, 8, tp=4, ep=64).expert_tp == 1  # the default is what train.py runs


def test_search_returns_only_fitting_sorted_layouts():
    model = ModelShape.from_config("glm5.3-flash")
    plans = search(model, get_device("h200"), 16, 8, pps=(1, 2), top=6)
    assert plans, "a 128 x H200 cluster should fit the 300B model"
    assert all(p.fits and p.peak <= p.usable for p in plans)
    keys = [(round(p.time.total_s, 3), p.phases["train"]) for p in plans]
    assert keys == sorted(keys)
    assert not search(model, get_device("h100"), 1, 8, pps=(1,))  # one node of 80 GB cannot hold 300B


def test_device_table_has_sources_and_required_devices():
    assert {"950dt", "950pr", "a3", "h100", "h200"} <= set(DEVICES)
    assert (DEVICES["950dt"].memory_gb, DEVICES["950pr"].memory_gb, DEVICES["h100"].memory_gb,
            DEVICES["h200"].memory_gb) == (144, 112, 80, 141)
    assert not DEVICES["950dt"].ipc
    for d in DEVICES.values():
        assert len(d.source) > 20, d.key


def test_docs_device_table_matches_code():
    text = (ROOT / "docs/planner.md").read_text()
    for d in DEVICES.values():
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{d.key}` |")), None)
        assert row is not None, f"docs/planner.md lacks a row for {d.key}"
        cells = [c.strip().rstrip("*") for c in row.strip("|").split("|")]
        assert [float(c) for c in cells[2:6]] == [d.memory_gb, d.hbm_tb_s, d.bf16_tflops, d.link_gb_s], d.key


def test_cli(capsys):
    args = ["--model", "glm5.3-flash", "--device", "950dt", "--nodes", "16", "--tp", "4", "--ep", "32", "--etp", "1"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "optimizer dist=False offload=True" in out and "recompute=none" in out
    assert plan_main(args + ["--format", "short"]) == 0
    assert re.search(r"peak [\d.]+ of [\d.]+ GB usable -> fits", capsys.readouterr().out)
    assert plan_main(["--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "glm5.3-flash" in err  # names the known models
    assert plan_main(["--device", "nope"]) == 2 and "950dt" in capsys.readouterr().err
    by_dp = args[:4] + args[6:] + ["--dp", "32", "--format", "json"]  # 32 * tp 4 = 128 devices = 16 nodes of 8
    assert plan_main(by_dp) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["nodes"] == 16
    assert plan_main(args[:4] + ["--tp", "4", "--dp", "3"]) == 2 and "whole number" in capsys.readouterr().err
    assert plan_main(["--model", "glm5-tiny", "--device", "h100", "--search", "--nodes", "1", "--top", "3"]) == 0
    assert "fitting layout" in capsys.readouterr().out


def test_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ValueError, match="not supported by the planner"):
        ModelShape.from_config(str(tmp_path))
    bad.write_text('{"model_type": "glm_moe_dsa", "hidden_size": 8}')
    with pytest.raises(ValueError, match="missing keys .*vocab_size"):
        ModelShape.from_config(str(bad))


def test_tiny_model_training_state_is_the_planned_bytes(tmp_path, capsys):
    """The planner's fp32 training state (params + grads + Adam's two moments, 16 bytes a parameter) against the
    bytes of the tensors a real optimizer step leaves, counted tensor by tensor (RSS growth, measured before, varied
    from 0.28x to 2.8x of it with what the process had freed or touched earlier)."""
    import torch
    from transformers import AutoModelForCausalLM

    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    overrides = dict(hidden_size=256, vocab_size=4096, intermediate_size=512, moe_intermediate_size=128,
                     q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     index_head_dim=32)
    ckpt = write_tiny_checkpoint(str(tmp_path / "tiny"), **overrides)
    shape = ModelShape.from_config(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3, foreach=False)
    ids = torch.randint(0, 4096, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    param_bytes = sum(nbytes(p) for p in model.parameters())
    assert param_bytes == shape.hf_param_count() * 4  # exact
    grad_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    moment_bytes = sum(nbytes(state[k]) for state in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    predicted = shape.hf_param_count() * (4 + 4 + 8)  # fp32 params + grads + Adam exp_avg/exp_avg_sq
    with capsys.disabled():
        print(f"\n[plan] tiny GLM-5 ({shape.hf_param_count():,} params): params+grads+adam predicted "
              f"{predicted / 2**20:.1f} MiB, tensors {(param_bytes + grad_bytes + moment_bytes) / 2**20:.1f} MiB")
    trained = sum(p.numel() for p in params if p.grad is not None)
    assert grad_bytes + moment_bytes == trained * (4 + 8)  # every trained parameter: its grad and two fp32 moments
    # The planner counts all parameters as trained; the DSA indexer's (its transformers forward runs without grad)
    # get no grad here: within 1% of the plan, never above it.
    assert 0.99 * predicted <= param_bytes + grad_bytes + moment_bytes <= predicted


def test_fewest_nodes_is_the_smallest_that_fits():
    from slime.plan.search import fewest_nodes

    model, device = ModelShape.from_config("glm5.3-flash"), get_device("h200")
    before = TrainSettings(max_tokens_per_gpu=4096, recompute="none", distributed_optimizer=False, with_mtp=False)
    after = replace(before, distributed_optimizer=True)
    offload = replace(after, optimizer_cpu_offload=True)
    found = {}
    for name, ts in (("before", before), ("after", after), ("offload", offload)):
        p = fewest_nodes(model, device, ts=ts, max_nodes=20, recompute_options=(ts.recompute, "full"))
        assert p is not None and p.fits, name
        n = p.layout.nodes
        if n > 1:  # one node fewer finds nothing that fits
            assert not search(model, device, n - 1, 8, ts, top=1, recompute_options=(ts.recompute, "full"), pps=(1,))
        found[name] = n
    # Sharding the optimizer state and moving it to the host can only lower the device count (at EP 72 the
    # experts have one data-parallel rank each, so only the host copy lowers it here).
    assert found["offload"] <= found["after"] <= found["before"] and found["offload"] < found["before"], found
    assert fewest_nodes(model, device, ts=before, max_nodes=2, recompute_options=("none",)) is None


def test_cli_fewest_table(capsys):
    assert plan_main(["--fewest", "h200,950dt", "--max-nodes", "16", "--search-pp", "1", "--no-mtp",
                      "--max-tokens-per-gpu", "4096", "--search-engine", "8,16,32"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| h", "| 9"))]
    assert [r.split("|")[1].strip() for r in rows] == ["h200", "950dt"]
    assert all(" x 8 = " in r for r in rows)


def test_pipeline_bubble_stretches_logprob_and_train_hand_computed(mini):
    from slime.plan.estimate import pipeline_bubble

    assert pipeline_bubble(4, 12) == 3 / 15 and pipeline_bubble(1, 7) == 0
    dev = replace(get_device("h200"), bf16_tflops=1e-9, hbm_tb_s=1e6)  # 1000 FLOP/s, memory effectively free
    rs = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=2, max_prompt_len=4, max_response_len=4,
                         avg_response_len=4, devices_per_engine=1, mem_fraction_static=0.5, logprob_passes=2)
    ts = TrainSettings(max_tokens_per_gpu=8, recompute="full", with_mtp=False)
    p = plan(mini, Layout(1, 2, pp=2), dev, ts, rs)
    fwd, tokens = 2 * 442 + 192 + 32, 4 * (4 + 4)  # as in the test above
    # 32 tokens of 8-token samples in 8-token micro-batches on the one DP rank: m = 4, bubble 1 / (4 + 1)
    assert p.micro_batches == 4 and p.time.bubble == pytest.approx(0.2)
    assert p.time.train_s == pytest.approx(4 * fwd * tokens / (2 * 1000) / 0.8)
    assert p.time.logprob_s == pytest.approx(2 * fwd * tokens / (2 * 1000) / 0.8)
    assert p.time.cp_comm_s == 0


def test_context_parallel_tokens_activations_and_gathers_hand_computed(mini):
    from slime.plan.memory import micro_batches_per_step, tokens_per_device

    ts = TrainSettings(max_tokens_per_gpu=8, recompute="full", with_mtp=False, longest_sample=20)
    # a 20-token sample exceeds the 8 x cp budget at cp 1 and 2: it is a micro-batch of its own, split over CP
    assert [tokens_per_device(Layout(1, cp, cp=cp), ts) for cp in (1, 2, 4)] == [20, 10, 8]
    assert micro_batches_per_step(4 * 20, Layout(1, 1), ts, 4) == 4  # one per sample
    assert micro_batches_per_step(4 * 20, Layout(1, 4, cp=4), ts, 4) == 3  # ceil(80 / (4 x 8))
    # saved per local token and layer, from the other CP rank's tokens: latent 2 + rope 2, and the up-projected
    # k (2 heads x qk_head 4) + kv_b output (2 x (nope 2 + v 2)) = 16
    none = replace(ts, recompute="none")
    assert layer_activation_elements(mini, Layout(1, 2, cp=2), none, moe=False, indexer=False) == 78 + 4 + 16
    assert layer_activation_elements(mini, Layout(1, 4, cp=4), none, moe=False, indexer=False) == 78 + 3 * 20
    # gathers: 1 B/s links; 32 tokens over cp 2 = 16 local tokens, 1 peer, 2 layers. Forward per token and layer:
    # latent (2+2) x 2 B + indexer key 2 x 2 B = 12 B; training with full recompute gathers twice and
    # reduce-scatters the latent grads: 2 x 12 + 8 = 32 B
    dev = replace(get_device("h200"), bf16_tflops=1e-9, hbm_tb_s=1e6, link_gb_s=1e-9)
    rs = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=2, max_prompt_len=4, max_response_len=4,
                         avg_response_len=4, devices_per_engine=1, mem_fraction_static=0.5, logprob_passes=2)
    p = plan(mini, Layout(1, 2, cp=2), dev, replace(ts, longest_sample=None), rs)
    fwd, tokens = 2 * 442 + 192 + 32, 4 * (4 + 4)
    assert p.time.cp_comm_s == pytest.approx(16 * 2 * 32 + 2 * 16 * 2 * 12)
    assert p.time.train_s == pytest.approx(4 * fwd * tokens / (2 * 1000) + 16 * 2 * 32)
