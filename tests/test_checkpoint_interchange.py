"""torch_dist checkpoints interchangeable with upstream slime's (Megatron-core TE key names), and its two
converters' command lines (tools/). Tiny random checkpoints, one per family, shared by the module."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = json.load(open(os.path.join(HERE, "data", "upstream_torch_dist_to_hf.json")))
FAMILIES = list(RECORDED["families"])
LAYOUT = {"tp": 1, "pp": 1, "ep": 1, "world_size": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """model_type -> its tiny HF checkpoint (the recorded one: seed 0, the recorded config overrides)."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    from slime_plugins.models.mimo.tiny import write_tiny_mimo_checkpoint

    root, made = tmp_path_factory.mktemp("interchange"), {}

    def get(model_type: str) -> str:
        if model_type not in made:
            overrides = RECORDED["families"][model_type]["overrides"]
            if model_type == "mimo":  # transformers has no mimo type: qwen2 plus MTP tensors (its own writer)
                made[model_type] = write_tiny_mimo_checkpoint(str(root / model_type), seed=0, **overrides)
            else:
                made[model_type] = write_tiny_checkpoint(str(root / model_type), model_type, seed=0, **overrides)
        return made[model_type]

    return get


def _digest(hf_dir: str) -> dict[str, list]:
    from safetensors.torch import load_file

    out = {}
    for fn in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        for name, t in load_file(fn).items():
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]
    return out


def _weight_keys(iter_dir: str) -> set[str]:
    from slime.backends.megatron.checkpoint.check import saved_weight_keys

    return saved_weight_keys(iter_dir)


# Upstream's qwen3_5 converter writes the vision-language checkpoint's names (model.language_model.*) for a
# text-only Qwen3.5 too; this project's export keeps the names of the checkpoint it came from (transformers'
# Qwen3_5ForCausalLM reads those). Every tensor is otherwise upstream's, bit for bit.
UPSTREAM_RENAMES = {"qwen3_5_text": ("model.language_model.", "model."),
                    "qwen3_5_moe_text": ("model.language_model.", "model.")}


def _upstream_tensors(model_type: str) -> dict[str, list]:
    old, new = UPSTREAM_RENAMES.get(model_type, ("", ""))
    tensors = RECORDED["families"][model_type]["tensors"]
    return {(new + k[len(old):] if old and k.startswith(old) else k): v for k, v in tensors.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_converters_round_trip_bit_exact_and_equal_upstreams_converter(model_type, tiny, tmp_path):
    """HF -> tools/convert_hf_to_torch_dist.py -> tools/convert_torch_dist_to_hf.py: every tensor of the
    original, bit for bit (names, dtypes, shapes), and what upstream's own converter wrote from this
    project's torch_dist checkpoint (recorded at upstream commit 624b824, with the same extra flags: MiMo's
    MODEL_ARGS with --mtp-num-layers 1, -a for Qwen3.5's vision tower)."""
    from slime.backends.megatron.checkpoint import keys as K
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist, torch_dist_to_hf

    hf, entry = tiny(model_type), RECORDED["families"][model_type]
    to_hf = entry.get("to_hf_flags", [])
    release = hf_to_torch_dist([*entry.get("to_torch_dist_flags", []), "--hf-checkpoint", hf,
                                "--save", str(tmp_path / "td")])
    assert release == str(tmp_path / "td" / "release")
    assert open(tmp_path / "td" / "latest_checkpointed_iteration.txt").read() == "release"
    keys = _weight_keys(release)
    assert K.detect_layout(keys) == K.UPSTREAM
    ours = ("q_proj", "o_proj", "router_weight", "experts.weight1", "kv_a_proj_with_mqa", "indexer.")
    assert "embedding.word_embeddings.weight" in keys and not [k for k in keys if any(o in k for o in ours)]
    common = torch.load(os.path.join(release, "common.pt"), weights_only=False)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    assert common["args"].num_layers == cfg.get("text_config", cfg)["num_hidden_layers"]  # Qwen3.5: its text model
    if "--mtp-num-layers" in entry.get("to_torch_dist_flags", []):
        mtp = "mtp.layers.0."
        assert {mtp + "eh_proj.weight", mtp + "transformer_layer.self_attention.linear_qkv.weight"} <= keys
        # a run without --enable-mtp-training reads the main model from it; the preflight names what it skips
        from slime.backends.megatron.checkpoint.check import check_checkpoint

        line = check_checkpoint(str(tmp_path / "td"), "--ref-load", cfg)
        n_mtp = len([k for k in keys if k.startswith("mtp.")])
        assert f"all {len(keys) - n_mtp} model weights present; {n_mtp} more not read: mtp.layers.0." in line, line
    torch_dist_to_hf(["--input-dir", str(tmp_path / "td"), "--output-dir", str(tmp_path / "hf"),
                      "--origin-hf-dir", hf, *to_hf])
    got = _digest(str(tmp_path / "hf"))
    assert got == _digest(hf)
    assert got == _upstream_tensors(model_type)


GLM5_KEYS = json.load(open(os.path.join(HERE, "data", "upstream_glm5_torch_dist_keys.json")))


def test_glm5_keys_equal_upstreams_glm5_spec(tiny, tmp_path):
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.hf_loader import load_hf_model

    model = load_hf_model(tiny("glm_moe_dsa"))
    C.save(str(tmp_path), 0, model, None, 0, LAYOUT, {})
    arch = model.arch
    want = set(GLM5_KEYS["model"])
    for i in range(arch.num_hidden_layers):
        rest = GLM5_KEYS["attention"] + GLM5_KEYS["dense_mlp" if arch.mlp_type(i) == "dense" else "moe_mlp"]
        want |= {f"decoder.layers.{i}.{r}" for r in rest}
    assert _weight_keys(str(tmp_path / "iter_0000000")) == want


def _earlier_save(model, root) -> str:
    """A checkpoint as this project wrote it before the upstream names: the model's own sharded keys."""
    from megatron.core import dist_checkpointing

    d = os.path.join(root, "iter_0000004")
    os.makedirs(d)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 4,
                             "slime": {"rollout_id": 4, "layout": LAYOUT}}, d)
    open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write("4")
    return d


@pytest.mark.parametrize("model_type", ["qwen3", "glm_moe_dsa"])
def test_earlier_names_are_still_read_and_named(model_type, tiny, tmp_path, caplog):
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint import keys as K
    from slime.backends.megatron.checkpoint.check import check_checkpoint
    from slime.backends.megatron.hf_loader import load_hf_model

    model = load_hf_model(tiny(model_type))
    want = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    d = _earlier_save(model, str(tmp_path))
    assert K.detect_layout(_weight_keys(d)) == K.EARLIER
    line = check_checkpoint(str(tmp_path), "--ref-load", json.load(open(os.path.join(tiny(model_type), "config.json"))))
    assert K.EARLIER in line and "all" in line
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    with caplog.at_level(logging.INFO, logger="slime.backends.megatron.checkpoint"):
        C.load_model_weights(str(tmp_path), model)
    assert any(K.EARLIER in r.getMessage() for r in caplog.records)
    for k, v in model.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, want[k]), k


def _megatron_gpt(arch):
    """megatron-core's own GPTModel of `arch` with the local layer spec, whose sharded_state_dict_keys_map
    gives the TE spec's key names (as upstream's GPU runs write them). MoE layers: the TE spec keeps their
    pre-MLP norm separate (`pre_mlp_layernorm`), the local spec would map it onto a fused fc1 norm."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if arch.n_routed_experts:
        moe = dict(num_moe_experts=arch.n_routed_experts, moe_router_topk=arch.num_experts_per_tok,
                   moe_ffn_hidden_size=arch.moe_intermediate_size, moe_router_pre_softmax=not arch.norm_topk_prob,
                   moe_layer_freq=[int(arch.mlp_type(i) != "dense") for i in range(arch.num_hidden_layers)],
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                   moe_token_dispatcher_type="alltoall")
    cfg = TransformerConfig(
        num_layers=arch.num_hidden_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.intermediate_size,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm, bias_activation_fusion=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, **moe)
    if arch.n_routed_experts:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        for i, layer in enumerate(spec.layer_specs):
            if arch.mlp_type(i) != "dense":
                layer.submodules.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=arch.vocab_size, max_sequence_length=64, position_embedding_type="rope",
                    rotary_base=arch.rope_parameters["rope_theta"],
                    share_embeddings_and_output_weights=arch.tie_word_embeddings).eval()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_megatron_gptmodel_reads_and_writes_the_same_checkpoints(model_type, tiny, tmp_path):
    """This project's checkpoint loads into megatron-core's GPTModel with equal logits, and GPTModel's own
    checkpoint (other weights) loads here with equal logits (float32, 1e-5 of max |logit|)."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.hf_loader import load_hf_model

    ours = load_hf_model(tiny(model_type)).eval()
    gpt = _megatron_gpt(ours.arch)
    C.save(str(tmp_path / "ours"), 1, ours, None, 0, LAYOUT, {})
    request = {k: v for k, v in gpt.sharded_state_dict().items() if not k.endswith("_extra_state")}
    missing, _ = gpt.load_state_dict(dist_checkpointing.load(request, str(tmp_path / "ours" / "iter_0000001")),
                                     strict=False)
    assert [m for m in missing if not m.endswith("_extra_state")] == []
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ours.arch.vocab_size, (2, 11), generator=gen)
    pos = torch.arange(11).expand(2, -1)

    def rel(a, b):
        return ((a - b).abs().max() / a.abs().max()).item()

    with torch.no_grad():
        mine = ours(ids, pos)
        assert mine.abs().max() > 0.1 and rel(mine, gpt(ids, pos, attention_mask=None)) < 1e-5
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        theirs = gpt(ids, pos, attention_mask=None)
    assert rel(theirs, mine) > 1e-2  # other weights now
    d = tmp_path / "gpt" / "iter_0000002"
    d.mkdir(parents=True)
    dist_checkpointing.save(gpt.sharded_state_dict(), str(d))
    (tmp_path / "gpt" / "latest_checkpointed_iteration.txt").write_text("2")
    C.load_model_weights(str(tmp_path / "gpt"), ours)
    with torch.no_grad():
        assert rel(theirs, ours(ids, pos)) < 1e-5


def test_preflight_names_missing_weights_in_one_line(tiny, tmp_path):
    from slime.backends.megatron.checkpoint.check import check_checkpoint
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist
    from slime.backends.megatron.checkpoint.layout import CheckpointFormatError

    hf_to_torch_dist(["--hf-checkpoint", tiny("llama"), "--save", str(tmp_path / "llama")])
    qwen3 = json.load(open(os.path.join(tiny("qwen3"), "config.json")))
    with pytest.raises(CheckpointFormatError) as e:
        check_checkpoint(str(tmp_path / "llama"), "--ref-load", qwen3)
    msg = str(e.value)
    assert "\n" not in msg and "--ref-load" in msg and "decoder.layers.self_attention.q_layernorm.weight" in msg
    llama = json.load(open(os.path.join(tiny("llama"), "config.json")))
    line = check_checkpoint(str(tmp_path / "llama"), "--ref-load", llama)
    assert "stacked layers" in line and "all 9 model weights present" in line


def test_converters_refuse_bad_input_in_one_line(tiny, tmp_path, capsys):
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist, torch_dist_to_hf

    hf = tiny("qwen3")
    with pytest.raises(SystemExit) as e:  # MODEL_ARGS of another model
        hf_to_torch_dist(["--num-layers", "36", "--swiglu", "--hf-checkpoint", hf, "--save", str(tmp_path / "x")])
    assert e.value.code == 2 and "--num-layers 36" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as e:
        torch_dist_to_hf(["--input-dir", str(tmp_path), "--output-dir", str(tmp_path / "out"), "--origin-hf-dir", hf])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--force" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_converted_checkpoint_loads_at_another_layout_and_saves_back_bit_exact(tiny, tmp_path):
    """Every model type of the GQA, GLM, DeepSeek, MiniMax and Qwen3-Next families, Qwen3.5's text types, MiMo
    (with its MTP layer) and a llama with Llama-3 rope scaling: the converter under 2 ranks (pipeline stages for the untied 2-layer
    models, as upstream's tool splits them; else replicas); the trainer's --load at TP2 or EP2: logits within
    1e-5 of max |logit| of transformers'; saved there and converted back: the original tensors."""
    import shutil

    from glm5_helpers import spawn_ranks

    from checkpoint_interchange_worker import run
    from slime.backends.megatron.checkpoint.convert import torch_dist_to_hf
    from slime_plugins.models.common.tiny import write_tiny_checkpoint
    from slime_plugins.models.registry import supported_model_types

    layouts = {"qwen3": (2, 1, 1), "llama": (2, 1, 1), "qwen2": (2, 1, 1), "glm4_moe": (2, 1, 1), "glm4": (2, 1, 1),
               "deepseek_v3": (2, 1, 1), "qwen3_moe": (1, 2, 1), "glm4_moe_lite": (1, 2, 1), "glm_moe_dsa": (1, 2, 1),
               "kimi_k2": (1, 2, 1), "minimax_m2": (2, 1, 1), "qwen3_next": (1, 2, 1), "qwen3_5_text": (2, 1, 1),
               "qwen3_5_moe_text": (1, 2, 1), "mimo": (2, 1, 1)}  # (tp, ep, pp)
    assert set(layouts) <= set(supported_model_types())
    # Kimi-K2 is DeepSeek-V3 under its own model_type (transformers has none): the reference runs the deepseek_v3 copy.
    kimi = str(tmp_path / "kimi_k2")
    shutil.copytree(tiny("deepseek_v3"), kimi)
    cfg = json.load(open(os.path.join(kimi, "config.json")))
    json.dump(cfg | {"model_type": "kimi_k2"}, open(os.path.join(kimi, "config.json"), "w"))
    # MiMo: transformers runs its main model as Qwen2ForCausalLM (the MTP tensors unused); converted with its
    # MODEL_ARGS (--mtp-num-layers 1), the MTP layer loaded at TP2 too and saved back.
    mimo_ref = str(tmp_path / "mimo_as_qwen2")
    shutil.copytree(tiny("mimo"), mimo_ref)
    cfg = json.load(open(os.path.join(mimo_ref, "config.json")))
    json.dump(cfg | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
              open(os.path.join(mimo_ref, "config.json"), "w"))
    hf_of = {m: kimi if m == "kimi_k2" else tiny(m) for m in layouts}
    ref_of = {m: {"kimi_k2": tiny("deepseek_v3"), "mimo": mimo_ref}.get(m, hf_of[m]) for m in layouts}
    cases = [(hf_of[m], ref_of[m], str(tmp_path / f"{m}_td"), str(tmp_path / f"{m}_saved"), layout,
              RECORDED["families"]["mimo"]["to_torch_dist_flags"] if m == "mimo" else []) for m, layout in layouts.items()]
    # Llama-3.x rope scaling (rope_type llama3; its original context 64 puts the 8 tokens' frequencies in all three
    # bands) at TP2: the scaled rotary comes from config.json, the tensors are llama's
    llama3 = write_tiny_checkpoint(str(tmp_path / "llama3_rope"), "llama", seed=0, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    cases.append((llama3, llama3, str(tmp_path / "llama3_td"), str(tmp_path / "llama3_saved"), (2, 1, 1), []))
    spawn_ranks(run, 2, cases, str(tmp_path / "logits.json"))
    rel = json.load(open(tmp_path / "logits.json"))
    assert set(rel) == {c[0] for c in cases} and max(rel.values()) < 1e-5, rel
    for m in ("llama", "glm4", "deepseek_v3", "minimax_m2"):  # two ranks converted these as two stages
        common = torch.load(str(tmp_path / f"{m}_td" / "release" / "common.pt"), weights_only=False)
        assert common["args"].pipeline_model_parallel_size == 2, m
    for hf, _, _, saved, _, _ in cases:
        out = str(tmp_path / (os.path.basename(hf) + "_hf"))
        torch_dist_to_hf(["--input-dir", os.path.join(saved, "iter_0000005"), "--output-dir", out, "--origin-hf-dir", hf])
        assert _digest(out) == _digest(hf)


def test_dry_run_names_the_ref_load_layout_and_refuses_another_models(tiny, tmp_path, capsys):
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist
    from slime.train import main

    hf_to_torch_dist(["--hf-checkpoint", tiny("llama"), "--save", str(tmp_path / "llama_td")])
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    argv = ["--prompt-data", str(tmp_path / "p.jsonl"), "--input-key", "prompt", "--label-key", "label",
            "--ref-load", str(tmp_path / "llama_td"), "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rm-type", "math", "--dry-run"]
    assert main(["--hf-checkpoint", tiny("llama"), *argv]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: --ref-load" in out and "stacked layers), all 9 model weights present" in out
    assert main(["--hf-checkpoint", tiny("qwen3"), *argv]) == 2
    err = [line for line in capsys.readouterr().out.splitlines() if "error" in line]
    assert len(err) == 1 and "lacks 2 of the 10 weights the qwen3 model" in err[0]


def test_vocab_padded_as_megatron_pads_it_and_removed_on_export(tmp_path):
    """A vocabulary of 300 rows is stored as 384 (make_vocab_size_divisible_by 128), the padding zero; the
    export keeps the 300 rows (what upstream's converter writes with --vocab-size 300)."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist, torch_dist_to_hf
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    hf = write_tiny_checkpoint(str(tmp_path / "llama300"), "llama", seed=3, vocab_size=300)
    release = hf_to_torch_dist(["--hf-checkpoint", hf, "--save", str(tmp_path / "td")])
    meta = dist_checkpointing.load_tensors_metadata(release)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert tuple(meta[key].global_shape) == (384, 64)
    table = dist_checkpointing.load({"t": meta["output_layer.weight"]}, release)["t"]
    assert table.shape == (384, 64) and not table[300:].any() and table[:300].abs().sum() > 0
    torch_dist_to_hf(["--input-dir", release, "--output-dir", str(tmp_path / "hf"), "--origin-hf-dir", hf,
                      "--vocab-size", "300"])
    assert _digest(str(tmp_path / "hf")) == _digest(hf)


def test_load_of_a_release_checkpoint_starts_at_rollout_0_with_its_weights(tiny, tmp_path):
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist
    from slime.backends.megatron.hf_loader import load_hf_model

    hf_to_torch_dist(["--hf-checkpoint", tiny("qwen3_moe"), "--save", str(tmp_path / "td")])
    model = load_hf_model(tiny("qwen3_moe"))
    want = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    resumed = C.load(str(tmp_path / "td"), model, None, 0, LAYOUT)
    assert (resumed.start_rollout_id, resumed.restored) == (0, ("model",))  # as --finetune: weights only
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))


def test_trainer_resume_of_a_dense_model_restores_weights_and_adam_moments(tiny, tmp_path):
    """A dense model's checkpoint (stacked layers, fused linear_qkv) with the optimizer: the fused and
    stacked Adam moments go back to their parameters (resume equals the saved state exactly)."""
    import random

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.backends.megatron.data import RolloutBatch
    from slime.config.arguments import parse_args

    args = parse_args(["--hf-checkpoint", tiny("qwen3"), "--num-rollout", "4", "--global-batch-size", "4",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--lr", "3e-3",
                       "--save", str(tmp_path / "save")])
    actor = MegatronTrainRayActor(1, 0)
    assert actor.init(args, with_ref=False) == 0
    rng = random.Random(0)

    def step():
        seqs = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 11))] for _ in range(4)]
        batch = RolloutBatch(tokens=seqs, response_lengths=[3] * 4, rewards=[1.0, 0.0, 1.0, 0.0],
                             loss_masks=[[1, 1, 1]] * 4)
        lp = actor.compute_log_probs(batch)["log_probs"]["old_log_probs"]
        batch.old_log_probs = [lp[i] for i in range(4)]
        batch.advantages = [torch.ones(3) for _ in range(4)]
        actor.train(1, batch)

    def state():
        params = {n: p.detach().clone() for n, p in actor.model.module.named_parameters()}
        moments = {}
        for sub in actor.optimizer.chained_optimizers:
            for group in sub.optimizer.param_groups:
                for p in group["params"]:
                    for k, v in sub.optimizer.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.dim():
                            moments[(id(p), k)] = v.clone()
        return params, moments

    step()
    actor.save(1, {})
    assert "decoder.layers.self_attention.linear_qkv.weight" in _weight_keys(str(tmp_path / "save" / "iter_0000001"))
    saved_params, saved_moments = state()
    assert saved_moments and all(v.abs().sum() > 0 for v in saved_moments.values())
    step()
    moved_params, moved_moments = state()
    assert any(not torch.equal(saved_params[n], p) for n, p in moved_params.items())
    assert any(not torch.equal(saved_moments[k], v) for k, v in moved_moments.items())
    resumed = C.load(str(tmp_path / "save"), actor.model, actor.optimizer, 0, actor._layout())
    assert resumed.restored == ("model", "optimizer", "rng")
    params, moments = state()
    assert all(torch.equal(saved_params[n], p) for n, p in params.items())
    assert moments.keys() == saved_moments.keys() and all(torch.equal(saved_moments[k], v) for k, v in moments.items())


def test_bf16_glm5_round_trips_in_its_dtypes(tmp_path):
    """bf16 GLM-5: the indexer gate the model keeps in float32 goes back in the bf16 the checkpoint stored."""
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist, torch_dist_to_hf
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    hf = write_tiny_checkpoint(str(tmp_path / "glm5_bf16"), "glm_moe_dsa", seed=1, dtype="bfloat16")
    release = hf_to_torch_dist(["--hf-checkpoint", hf, "--save", str(tmp_path / "td")])
    torch_dist_to_hf(["--input-dir", release, "--output-dir", str(tmp_path / "hf"), "--origin-hf-dir", hf])
    want = _digest(hf)
    assert {d for d, _, _ in want.values()} == {"bfloat16", "float32"}  # the router gate is float32 in the file
    assert _digest(str(tmp_path / "hf")) == want


def _upstream_training_save(ddp, optimizer, root: str, iteration: int, sharding: str) -> str:
    """A checkpoint as upstream's training run saves it (Megatron-LM's save_checkpoint: model, optimizer with
    the distributed optimizer's sharding type, iteration; no `slime` entry). On CPU its fully_reshardable
    form needs --distrib-optim-fully-reshardable-mem-efficient (gloo), the same tensors on disk."""
    from megatron.core import dist_checkpointing

    d = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(d)
    state = {"model": ddp.module.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": iteration}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata={
        "distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True,
        "distrib_optim_fully_reshardable_mem_efficient": True})
    dist_checkpointing.save(state, d)
    open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write(str(iteration))
    return d


def _tensors(iter_dir: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(iter_dir)
    loaded = dist_checkpointing.load(dict(meta), iter_dir)  # with the common state merged in
    return {k: loaded[k] for k in meta}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_upstream_optimizer_state_resumes_here_or_is_refused_in_one_line(model_type, tiny, tmp_path, capsys):
    """megatron-core's GPTModel (upstream's TE names) trained 2 Adam steps with the distributed optimizer, saved as
    upstream's training run saves it. Its model-space optimizer state (--dist-ckpt-optim-fully-reshardable)
    resumes here: step 2, and saved again here every weight and Adam tensor equals upstream's bit for bit.
    Megatron-LM's default dp_reshardable form (flat grad buckets) is refused in one line naming --no-load-optim,
    with which its weights and iteration load."""
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.check import check_checkpoint
    from slime.backends.megatron.checkpoint.layout import CheckpointFormatError
    from slime.backends.megatron.hf_loader import load_hf_model
    from slime.backends.megatron.model_setup import finish_step
    from slime.backends.megatron.optimizer import build_optimizer

    ours = load_hf_model(tiny(model_type))
    gpt, gopt = build_optimizer(_megatron_gpt(ours.arch).train(), 1e-2, use_distributed_optimizer=True)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, ours.arch.vocab_size, (2, 9), generator=gen)
    for _ in range(2):
        gpt(ids, torch.arange(9).expand(2, -1), attention_mask=None).float().pow(2).mean().backward()
        finish_step(gpt, gopt)
    model_space = _upstream_training_save(gpt, gopt, str(tmp_path / "fully_reshardable"), 7, "fully_reshardable")
    buckets = _upstream_training_save(gpt, gopt, str(tmp_path / "dp_reshardable"), 7, "dp_reshardable")

    ddp, opt = build_optimizer(ours, 1e-2, use_distributed_optimizer=True)
    resumed = C.load(str(tmp_path / "fully_reshardable"), ddp, opt, 0, LAYOUT)
    assert (resumed.start_rollout_id, resumed.restored) == (8, ("model", "optimizer"))
    assert C.optimizer_step(opt) == 2
    again = C.save(str(tmp_path / "ours"), 8, ddp, opt, 0, LAYOUT, {})
    theirs, mine = _tensors(model_space), _tensors(again)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in theirs) and theirs.keys() <= mine.keys()
    assert [k for k, t in theirs.items() if not torch.equal(t, mine[k])] == []

    cfg = json.load(open(os.path.join(tiny(model_type), "config.json")))
    for refuse in (lambda: C.load(str(tmp_path / "dp_reshardable"), ddp, opt, 0, LAYOUT),
                   lambda: check_checkpoint(str(tmp_path / "dp_reshardable"), "--load", cfg, optimizer=True)):
        with pytest.raises(CheckpointFormatError) as e:
            refuse()
        assert "\n" not in str(e.value) and "dp_reshardable" in str(e.value) and "--no-load-optim" in str(e.value)
    assert "all" in check_checkpoint(str(tmp_path / "dp_reshardable"), "--load", cfg, optimizer=False)
    from slime.train import main

    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    argv = ["--hf-checkpoint", tiny(model_type), "--load", str(tmp_path / "dp_reshardable"), "--prompt-data",
            str(tmp_path / "p.jsonl"), "--input-key", "prompt", "--label-key", "label", "--num-rollout", "9",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rm-type", "math",
            "--dry-run"]
    capsys.readouterr()
    assert main(argv) == 2  # before Ray starts: the dry run (and the preflight) refuse it in one line
    err = [line for line in capsys.readouterr().out.splitlines() if "error" in line]
    assert len(err) == 1 and "--no-load-optim" in err[0]
    assert main([*argv, "--no-load-optim"]) == 0
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.fill_(float("nan"))
    resumed = C.load(str(tmp_path / "dp_reshardable"), ddp, opt, 0, LAYOUT, C.LoadOptions(optimizer=False))
    assert (resumed.start_rollout_id, resumed.restored) == (8, ("model",))
    weights = _tensors(C.save(str(tmp_path / "ours_weights"), 8, ddp, None, 0, LAYOUT, {}))
    assert all(torch.equal(t, weights[k]) for k, t in theirs.items() if not k.startswith("optimizer."))
    assert os.path.basename(buckets) == "iter_0000007"
