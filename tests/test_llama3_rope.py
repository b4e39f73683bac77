"""Llama-3.x rope scaling (config.json rope_scaling rope_type "llama3"; Megatron's --use-rope-scaling) in the llama
family:
- a tiny llama with llama3 scaling whose original context (64) is shorter than the sequence (100 tokens), so all
  three frequency bands occur (kept, divided by the factor, smoothed): logits within 1e-5 of max |logit| and grads
  within 1e-5 of each tensor's max |grad| (+1e-7) against transformers' LlamaForCausalLM; inv_freq bit-equal;
- the published Llama-3.1-8B config: our inverse frequencies equal megatron-core's own llama-3 scaling
  (RotaryEmbedding(rope_scaling=True), what upstream's GPU trainer runs) within float32 rounding;
- upstream's MODEL_ARGS (scripts/models/llama3.1-8B-Instruct.sh, llama3.2-3B-Instruct.sh at THUDM/slime 624b824a8)
  agree with those configs; --use-rope-scaling left out, or a wrong --rotary-scaling-factor, is one line each."""

from __future__ import annotations

import pytest
import torch
from glm5_helpers import hf_grads_by_checkpoint_name, hf_model, megatron_grads_by_hf_name, random_batch

VOCAB = 512
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# Llama-3.1-8B-Instruct's published config.json (shape fields)
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
              "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
# Llama-3.2-3B-Instruct's: 28 layers of 3072, factor 32, tied embeddings
LLAMA32_3B = LLAMA31_8B | {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_hidden_layers": 28,
                           "tie_word_embeddings": True, "head_dim": 128,
                           "rope_scaling": LLAMA31_8B["rope_scaling"] | {"factor": 32.0}}
_COMMON = ["--swiglu", "--group-query-attention", "--num-query-groups", "8", "--max-position-embeddings", "131072",
           "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon",
           "1e-5", "--rotary-base", "500000", "--vocab-size", "128256", "--kv-channels", "128", "--use-rope-scaling"]
UPSTREAM_MODEL_ARGS = {  # scripts/models/<name>.sh MODEL_ARGS at THUDM/slime 624b824a8
    "llama3.1-8B-Instruct": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                             "--num-attention-heads", "32", *_COMMON, "--rotary-scaling-factor", "8.0",
                             "--untie-embeddings-and-output-weights"],
    "llama3.2-3B-Instruct": ["--num-layers", "28", "--hidden-size", "3072", "--ffn-hidden-size", "8192",
                             "--num-attention-heads", "24", *_COMMON, "--rotary-scaling-factor", "32.0"],
}


def test_llama3_scaled_rope_matches_transformers(accel, tmp_path):
    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(str(tmp_path / "llama3"), "llama", seed=3, initializer_range=0.2,
                                 rope_parameters=LLAMA3_ROPE)
    model, ref = load_hf_model(ckpt), hf_model(ckpt)
    assert torch.equal(model.rotary.inv_freq.cpu(), ref.model.rotary_emb.inv_freq.float())
    wavelen = 2 * torch.pi / (10000.0 ** (-torch.arange(0, 16, 2) / 16))
    assert (wavelen > 64).any() and (wavelen < 16).any() and ((wavelen > 16) & (wavelen < 64)).any()  # 3 bands
    ids, pos = random_batch(1, 100, VOCAB, 0)
    weight = torch.randn(1, 100, VOCAB, generator=torch.Generator().manual_seed(0))
    logits = model(ids.to(accel.device()), pos.to(accel.device())).cpu()
    ref_logits = ref(ids, position_ids=pos).logits
    assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) <= 1e-5
    (logits * weight).sum().backward()
    (ref_logits * weight).sum().backward()
    ours, theirs = megatron_grads_by_hf_name(model), hf_grads_by_checkpoint_name(ref)
    assert ours.keys() == theirs.keys()
    for name, g in theirs.items():
        assert float((ours[name].cpu() - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-7, name


@pytest.mark.parametrize("config", [LLAMA31_8B, LLAMA32_3B], ids=["llama3.1-8B", "llama3.2-3B"])
def test_published_llama3_inv_freq_equals_megatrons_rope_scaling(config):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from slime_plugins.models.common.rope import RotaryTable
    from slime_plugins.models.registry import parse_hf_config

    family, arch = parse_hf_config(config)
    assert family.name == "llama" and arch.rope_type == "llama3"
    ours = RotaryTable(arch).inv_freq
    factor = config["rope_scaling"]["factor"]
    megatron = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                               rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq
    torch.testing.assert_close(ours, megatron.float(), rtol=1e-6, atol=0)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    assert torch.equal(ours[:8], plain[:8]) and torch.allclose(ours[-4:], plain[-4:] / factor)  # bands kept / divided


def _parse(argv):
    from slime.config.arguments import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.parametrize("name,config", [("llama3.1-8B-Instruct", LLAMA31_8B), ("llama3.2-3B-Instruct", LLAMA32_3B)])
def test_upstream_llama3_model_args_agree_and_disagreements_are_one_line(name, config):
    from slime.config.model_args import model_arg_mismatches

    argv = UPSTREAM_MODEL_ARGS[name]
    assert model_arg_mismatches(_parse(argv), config) == []
    without = [a for a in argv if a != "--use-rope-scaling"]
    assert model_arg_mismatches(_parse(without), config) == [
        "--use-rope-scaling absent: config.json says rope_scaling rope_type llama3"]
    factor = argv.index("--rotary-scaling-factor") + 1
    wrong = argv[:factor] + ["4.0"] + argv[factor + 1:]
    assert model_arg_mismatches(_parse(wrong), config) == [
        f"--rotary-scaling-factor 4.0: config.json says rope_scaling.factor={config['rope_scaling']['factor']}"]
    plain = {k: v for k, v in config.items() if k != "rope_scaling"}
    assert model_arg_mismatches(_parse(without + []), plain) == [
        f"--rotary-scaling-factor {float(argv[factor])}: config.json says rope_scaling.factor=1.0"]
