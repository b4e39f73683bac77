"""The minimax_m2 family (MiniMax-M2 / M2.5: GQA with q/k RMSNorm over all heads at once, partial rotary, a
sigmoid-routed MoE with expert bias in every layer, checkpoint names `block_sparse_moe.experts.{e}.w1|w3|w2`) on
megatron-core against transformers' MiniMaxM2ForCausalLM, float32, on a tiny random checkpoint it wrote:
- logits within 1e-5 of max |logit|, grads of sum(logits * w) within 1e-5 of each tensor's max |grad| (+1e-7);
- export_hf and save_hf give the checkpoint back bit for bit (transformers loads the saved one, same logits);
- the embedded engine's sampled log-probs equal the trainer's (5e-5), before and after a weight sync that
  lands on every one of its tensors under the checkpoint's names;
- 2 gloo ranks at tp=2 (the full-width norms gather q / k over TP), ep=2 and cp=2: the same bounds after
  megatron DDP's reduction, export on every rank, equal grad norms, torch_dist written at one layout loaded at
  the others; pp=2 through megatron's pipeline schedule (one layer per stage; logits 1e-5, each stage's grads,
  export and save_hf of both stages: tests/model_families_parallel_worker.py, tests/glm5_parallel_worker.py);
- the published config (scripts/models/configs/minimax-m2.json: rotary_dim 64 of 128) reads as transformers does."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from glm5_helpers import hf_grads_by_checkpoint_name, hf_model, megatron_grads_by_hf_name, megatron_state_cleanup, random_batch
from safetensors.torch import load_file

from slime.backends.megatron import export_hf, load_hf_model, save_hf

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def _clean_megatron_state():
    yield from megatron_state_cleanup()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("minimax") / "m2"), "minimax_m2", seed=3,
                                 initializer_range=0.2)


def _rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def checkpoint_grads(ref) -> dict[str, torch.Tensor]:
    """transformers' grads under the MiniMax-M2 checkpoint's names (Mixtral layout)."""
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    out = {}
    for name, g in hf_grads_by_checkpoint_name(ref).items():
        name = re.sub(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
                      lambda m: f".experts.{m.group(1)}.{names[m.group(2)]}.", name)
        out[name.replace(".mlp.", ".block_sparse_moe.")] = g
    return out


def test_published_config_reads_as_transformers_does():
    from transformers import AutoConfig

    from slime_plugins.models.registry import parse_hf_config

    cfg = json.loads((ROOT / "scripts/models/configs/minimax-m2.json").read_text())
    family, arch = parse_hf_config(cfg)
    hf = AutoConfig.for_model("minimax_m2", **{k: v for k, v in cfg.items() if k != "model_type"})
    assert family.name == "minimax_m2" and arch.rotary_dim == 64 == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert (arch.n_routed_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (256, 8, 1536)
    assert arch.mlp_layer_types == ("sparse",) * 62 and arch.router == "sigmoid" and arch.n_shared_experts == 0
    assert not arch.qk_norm  # the family's attention norms q and k over all heads, not the shared per-head norm
    from slime_plugins.models.registry import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="qk_norm_type='per_head'"):
        parse_hf_config(cfg | {"qk_norm_type": "per_head"})


def test_logits_and_grads_match_transformers(accel, ckpt):
    model = load_hf_model(ckpt)
    ref = hf_model(ckpt)
    for seed, (batch, seq) in enumerate([(2, 5), (1, 17)]):
        ids, pos = random_batch(batch, seq, VOCAB, seed)
        weight = torch.randn(batch, seq, VOCAB, generator=torch.Generator().manual_seed(seed))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        logits = model(ids.to(accel.device()), pos.to(accel.device())).cpu()
        ref_logits = ref(ids, position_ids=pos).logits
        assert _rel_max(logits, ref_logits) <= 1e-5, seed
        (logits * weight).sum().backward()
        (ref_logits * weight).sum().backward()
        ours, theirs = megatron_grads_by_hf_name(model), checkpoint_grads(ref)
        assert ours.keys() == theirs.keys()
        for name, g in theirs.items():
            err = float((ours[name].cpu() - g).abs().max())
            assert err <= 1e-5 * float(g.abs().max()) + 1e-7, (name, err, float(g.abs().max()))


def test_export_and_save_hf_round_trip_bit_exact(ckpt, tmp_path):
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in original)  # the published layout
    model = load_hf_model(ckpt)
    exported = {n: t for bucket in export_hf(model, bucket_bytes=1 << 14) for n, t in bucket}
    assert exported.keys() == original.keys()
    assert [n for n in original if not torch.equal(exported[n].cpu(), original[n])] == []
    save_hf(model, str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[n], original[n]) for n in original)
    ids, pos = random_batch(1, 7, VOCAB, 4)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "saved")(ids, position_ids=pos).logits,
                                   hf_model(ckpt)(ids, position_ids=pos).logits, rtol=0, atol=0)


def trainer_logprobs(model, prompts, responses) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response, all sequences in one packed (THD) forward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime.accelerator import get_accelerator

    seqs = [p + r for p, r in zip(prompts, responses)]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    longest = max(len(s) for s in seqs)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=packed)[0]
    return [get_accelerator().ops.token_log_probs(logits[s + len(p) - 1: s + len(p) + len(r) - 1], torch.tensor(r))[0]
            .float() for s, p, r in zip(cu.tolist(), prompts, responses)]


def engine_matches_trainer(model, path: str) -> None:
    """The embedded engine's sampled log-probs equal the trainer's (5e-5); after moving the trainer's weights and
    syncing export_hf's tensors (every name landing bit for bit on the engine's tensor), again."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig

    engine = EmbeddedEngine(EngineConfig(model_path=path))
    prompts = [random_batch(1, n, VOCAB, 30 + n)[0][0].tolist() for n in (3, 6)]
    try:
        for step in range(2):
            outs = [engine.generate(p, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i + 10 * step,
                                        "ignore_eos": True}, return_logprob=True) for i, p in enumerate(prompts)]
            for o, lp in zip(outs, trainer_logprobs(model, prompts, [o.output_ids for o in outs])):
                assert len(o.logprobs) == 6
                torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float32), lp, rtol=0, atol=5e-5)
            if step == 0:
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std().clamp(min=1e-3))
                named = [(n, t.contiguous()) for bucket in export_hf(model) for n, t in bucket]
                assert sorted(n for n, _ in named) == sorted(engine.name_map.checkpoint_names())
                assert engine.update_from_named_tensors(named, weight_version="1") == len(named)
                assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in named)
    finally:
        engine.shutdown()


def test_engine_logprobs_match_the_trainer_before_and_after_a_weight_sync(ckpt):
    engine_matches_trainer(load_hf_model(ckpt), ckpt)


def _ranks(rank: int, port: int, cases: list, root: str) -> None:
    import model_families_parallel_worker as worker

    worker.tied_needs_one_stage = lambda cases: None  # the qwen3 check of that worker's own test
    worker.run(rank, port, cases, root)


@pytest.mark.timeout(300)
def test_tp2_ep2_cp2_match_transformers(ckpt, tmp_path):
    from rank_spawn import spawn

    from slime.utils.net import free_port

    ids, pos = random_batch(2, 12, VOCAB, 8)  # 12 % tp == 0 for sequence parallel
    weight = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(8))
    ref = hf_model(ckpt)
    logits = ref(ids, position_ids=pos).logits
    (logits * weight).sum().backward()
    torch.save({"ids": ids, "pos": pos, "weight": weight, "logits": logits.detach(), "grads": checkpoint_grads(ref)},
               tmp_path / "ref.pt")
    cases = [("minimax_m2", ckpt, str(tmp_path / "ref.pt"), [(1, 1), (2, 1), (1, 2), "cp2", "pp2"])]
    spawn(_ranks, args=(free_port(), cases, str(tmp_path / "torch_dist")), nprocs=2, join=True)
