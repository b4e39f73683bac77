"""The model-family conformance suite: every registered HF model_type (tests/model_conformance.py builds one case
per model_type from the model registry; a new family joins by registering a tiny config) on megatron-core against
transformers' model of the same tiny random checkpoint, float32:
- logits within the case's bound of max |logit| (default 1e-5) for several seeds and lengths; grads of
  sum(logits * w) per tensor within bound * max |grad| + 1e-7 (default 1e-5; op order differs: grouped experts,
  packed attention), on cpu and on the Ascend path against the torch_npu simulator;
- export_hf gives the checkpoint back bit for bit, in several buckets; save_hf writes it and its config.json back
  (only dtype may differ), and transformers' logits on the saved checkpoint are identical;
- packed sequences (THD: every row of those shapes and a 1-token sequence in one forward; GLM-5's rows are long
  enough for DSA to drop keys) equal each sequence run unpacked (elementwise 1e-5 + 1e-5 relative);
- the embedded engine's sampled log-probs equal the trainer's teacher-forced ones (5e-5: KV-cached decode against
  a full pass) before and after a weight sync of the exported tensors (MTP layers left out, as weight sync sends
  them to an engine without a draft), which lands on every engine tensor bit for bit;
- 2 gloo ranks (tests/model_conformance_worker.py) per family's layouts: tp2 [sequence parallel], ep2, dp2 through
  megatron DDP (logits 1e-5 of transformers', reduced grads within the case's bound, export on every rank, megatron's
  tensor-parallel attributes, equal grad norms, a torch_dist checkpoint written at the first layout loading at the
  others), cp2 (logits gathered back 1e-5, grads after the DP x CP reduction), pp2 through megatron's pipeline schedule
  (tests/glm5_parallel_worker.py), and for a tied checkpoint pp2 as one clear error;
- a case with a trained MTP layer (Case.mtp_reference; GLM-5.3-Flash's, tests/glm5_next_mtp_reference.py), float64:
  depth-1 MTP logits within the case's bound of the reference's (glm5_next: 5e-6 of max |logit|, measured 8.3e-7),
  the MTP loss (the trainer's mtp_loss) within 1e-6 relative (measured 6.9e-8) and every grad of it, the MTP
  layer's and the main model's, within the case's bound of max |grad| (glm5_next: 5e-5, measured 1.4e-6 on the MTP
  layer, 1.5e-5 on the main model's mHC scales); at its 2-rank layouts (tests/mtp_layouts_worker.py: tp2, ep2, pp2
  with the MTP block on the last stage, cp2 with the MTP inputs one token ahead from the whole pack), float32, the
  main and MTP losses (1e-6 relative; measured <= 2.2e-7), logits and MTP logits (1e-5) and every grad (5e-5 of
  max |grad| + 1e-7; measured at most 0.78 of that bound, layer 0's hc_attn_scale at ep2: a sum over every token) of
  the single rank, and the all-stages export on every rank bit for bit.
Family-specific behaviour (configs as published, other MTP layers against their references, DSA token dropping,
fused expert layouts, bad checkpoints) stays in the families' own test files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from glm5_helpers import megatron_grads_by_hf_name, random_batch
from model_conformance import (EXEMPT, MTP_SCALE, VOCAB, Case, assert_grads_match, cases, main_and_mtp_losses,
                               reference_grads, reference_model, rel_max, resolve_hook, trainer_logprobs,
                               write_checkpoint)
from safetensors.torch import load_file

from slime.backends.megatron import export_hf, load_hf_model, save_hf

CASES = cases()
LAYOUT_CASES = [c for c in CASES if c.layouts]


def _running(check: str) -> list[Case]:
    return [c for c in CASES if check in c.checks]


def _ids(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.name) for c in cases]


def _accel_ids(cases: list[Case]) -> list:
    """(accelerator, case) pairs: every accelerator of tests/conftest.py's ACCEL_PARAMS, npu-sim where the case runs it."""
    from conftest import ACCEL_PARAMS

    out = []
    for case in cases:
        for accel in ACCEL_PARAMS:
            name, marks = (accel, ()) if isinstance(accel, str) else (accel.values[0], accel.marks)
            if name != "npu-sim" or case.npu_sim:
                out.append(pytest.param(name, case, id=f"{name}-{case.name}", marks=marks))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case -> its tiny checkpoint, written on first use (a -k selection writes only its own)."""
    root, written = tmp_path_factory.mktemp("conformance"), {}

    def get(case: Case) -> str:
        if case.name not in written:
            written[case.name] = write_checkpoint(case, str(root / case.name))
        return written[case.name]

    return get


def test_every_registered_model_type_is_a_case():
    """Each model_type the registry serves has a case whose tiny config builds, or a stated exemption (an exemption
    may name a model_type whose family is not registered yet)."""
    from slime_plugins.models.common.tiny import tiny_config
    from slime_plugins.models.registry import families

    served = {t for f in families() for t in f.model_types}
    covered = {c.model_type for c in CASES}
    assert served - set(EXEMPT) == covered, f"model_types without a case: {sorted(served - set(EXEMPT) - covered)}"
    assert not set(EXEMPT) & covered, sorted(EXEMPT)
    for case in CASES:
        if case.write == "tiny":
            tiny_config(case.model_type, **case.overrides)  # a family without one: ValueError naming the model_type
    assert {c.family for c in LAYOUT_CASES} <= {f.name for f in families()}


@pytest.mark.parametrize("accel,case", _accel_ids(_running("logits")), indirect=["accel"])
def test_logits_and_grads_match_transformers(accel, checkpoint, case):
    """Each shape's logits and grads against transformers; then every row of every shape and a 1-token sequence
    packed into one THD forward: each sequence's logits equal its unpacked ones (1e-5)."""
    model = load_hf_model(checkpoint(case))
    hf_prefix = getattr(model.arch, "hf_prefix", "model")
    ref = reference_model(case, checkpoint(case))
    separate = []  # (token ids, their logits run unpacked)
    for seed, (batch, seq) in enumerate(case.shapes):
        ids, pos = random_batch(batch, seq, VOCAB, seed)
        weight = torch.randn(batch, seq, VOCAB, generator=torch.Generator().manual_seed(seed))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        logits = model(ids.to(accel.device()), pos.to(accel.device())).cpu()
        ref_logits = ref(ids, position_ids=pos).logits
        tol = case.npu_sim_logits_tol if getattr(accel, "simulated", False) and case.npu_sim_logits_tol else case.logits_tol
        assert rel_max(logits, ref_logits) <= tol, (seed, rel_max(logits, ref_logits))
        (logits * weight).sum().backward()
        (ref_logits * weight).sum().backward()
        assert_grads_match(megatron_grads_by_hf_name(model), reference_grads(case, ref, hf_prefix), case.grad_tol,
                           f"seed {seed}")
        separate += list(zip(ids, logits.detach()))
    one = random_batch(1, 1, VOCAB, 20)[0]
    with torch.no_grad():
        separate.append((one[0], model(one.to(accel.device()), torch.zeros_like(one).to(accel.device()))[0].cpu()))
        _assert_packed_equals_separate(model, separate, accel.device())


def _assert_packed_equals_separate(model, separate: list, device) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [len(ids) for ids, _ in separate]
    cu = torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    ids = torch.cat([ids for ids, _ in separate])[None].to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    out = model(ids, pos, packed_seq_params=packed)[0].cpu()
    for (_, alone), start in zip(separate, cu.tolist()):
        excess = (out[start:start + len(alone)] - alone).abs() - (1e-5 + 1e-5 * alone.abs())  # assert_close's bound
        assert float(excess.max()) <= 0, f"packed sequence of {len(alone)} tokens: {float(excess.max())} over the bound"


@pytest.mark.parametrize("case", _ids(_running("export")))
def test_export_and_save_hf_round_trip_bit_exact(checkpoint, case, tmp_path):
    src = checkpoint(case)
    original = load_file(os.path.join(src, "model.safetensors"))
    model = load_hf_model(src)
    buckets = list(export_hf(model, bucket_bytes=1 << 14))
    exported = {n: t for bucket in buckets for n, t in bucket}
    assert len(buckets) > 1 and exported.keys() == original.keys()
    assert [n for n in original if not torch.equal(exported[n].cpu(), original[n])] == []
    out = tmp_path / "saved"
    save_hf(model, str(out))
    assert not os.path.exists(str(out) + ".tmp-save")
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[n], original[n]) for n in original)
    config, source = (json.load(open(os.path.join(d, "config.json"))) for d in (out, src))
    assert {k: v for k, v in config.items() if k != "dtype"} == {k: v for k, v in source.items() if k != "dtype"}
    ids, pos = random_batch(1, 7, VOCAB, 4)
    with torch.no_grad():
        torch.testing.assert_close(reference_model(case, out)(ids, position_ids=pos).logits,
                                   reference_model(case, src)(ids, position_ids=pos).logits, rtol=0, atol=0)


def _synced_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What weight sync sends an engine without a speculative draft: the export minus the MTP layers."""
    from slime_plugins.models.common.weights import is_mtp_name

    return [(n, t.contiguous()) for bucket in export_hf(model) for n, t in bucket if not is_mtp_name(model.arch, n)]


@pytest.mark.parametrize("case", _ids(_running("engine")))
def test_engine_logprobs_match_the_trainer_before_and_after_a_weight_sync(checkpoint, case):
    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime_plugins.models.common.weights import is_mtp_name

    model = load_hf_model(checkpoint(case))
    engine = EmbeddedEngine(EngineConfig(model_path=checkpoint(case)))
    if case.reference_type:  # a model_type transformers lacks: the engine runs the reference's class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        assert type(engine.model).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[case.reference_type]
    prompts = [random_batch(1, n, VOCAB, 30 + n)[0][0].tolist() for n in (3, 6)]
    try:
        for step in range(2):
            outs = [engine.generate(p, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i + 10 * step,
                                        "ignore_eos": True}, return_logprob=True) for i, p in enumerate(prompts)]
            want = trainer_logprobs(model, prompts, [o.output_ids for o in outs])
            for o, lp in zip(outs, want):
                assert len(o.logprobs) == len(o.output_ids) == 6
                torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float32), lp, rtol=0, atol=5e-5)
            if step == 0:
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std().clamp(min=1e-3))
                named = _synced_tensors(model)
                kept = [n for n in engine.name_map.checkpoint_names() if is_mtp_name(model.arch, n)]  # vision tower
                assert sorted(n for n, _ in named) == sorted(set(engine.name_map.checkpoint_names()) - set(kept))
                assert engine.update_from_named_tensors(named, weight_version="1") == len(named)
                assert all(torch.equal(engine.name_map.resolve(n), t) for n, t in named)
    finally:
        engine.shutdown()


def _mtp_reference(case: Case, ckpt: str, ids, pos, weight) -> torch.Tensor | None:
    """Depth-1 MTP logits the layouts must give: the family's own reference where its test file has one, else
    the single-rank model's; None without MTP layers in the checkpoint."""
    from slime_plugins.models.registry import get_family

    family = get_family(case.model_type)
    if not family.supports_mtp or not json.load(open(os.path.join(ckpt, "config.json"))).get("num_nextn_predict_layers"):
        return None
    if case.family == "mimo":
        from test_mimo_family import mtp_reference

        return mtp_reference(ckpt, ids, pos, weight)[0].float()
    with torch.no_grad():
        return load_hf_model(ckpt, load_mtp=True)(ids, pos, mtp_logits=True)[1][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", _ids(LAYOUT_CASES))
def test_layouts_match_transformers(case, checkpoint, tmp_path):
    from model_conformance_worker import run
    from rank_spawn import spawn

    from slime.utils.net import free_port

    layouts = case.layouts
    if case.layout_overrides:
        ckpt = write_checkpoint(case, str(tmp_path / "ckpt"), **case.layout_overrides)
    else:
        ckpt = checkpoint(case)
    from slime_plugins.models.registry import parse_hf_config

    config = json.load(open(os.path.join(ckpt, "config.json")))
    if not parse_hf_config(config)[1].n_routed_experts:
        layouts = tuple(x for x in layouts if x != "ep2")  # a dense model has no experts to place
    ids, pos = random_batch(2, 12, VOCAB, 8)  # 12 % tp == 0 (sequence parallel), % (2 * cp) == 0
    weight = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(8))
    ref = reference_model(case, ckpt)
    logits = ref(ids, position_ids=pos).logits
    (logits * weight).sum().backward()
    saved = {"ids": ids, "pos": pos, "weight": weight, "logits": logits.detach(), "grad_tol": case.grad_tol,
             "grads": reference_grads(case, ref, getattr(parse_hf_config(config)[1], "hf_prefix", "model"))}
    mtp = _mtp_reference(case, ckpt, ids, pos, weight)
    if mtp is not None:
        saved["mtp_logits"] = mtp
    torch.save(saved, tmp_path / "ref.pt")
    spawn(run, args=(free_port(), case.name, ckpt, str(tmp_path / "ref.pt"), layouts, str(tmp_path / "torch_dist")),
          nprocs=2, join=True)


def _mtp_loss_reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-sample mean cross entropy of token t + 2 over the rows that have one, summed, times MTP_SCALE / samples."""
    lp = torch.log_softmax(logits[:, :-2], dim=-1).gather(-1, ids[:, 2:, None])[..., 0]
    return -lp.mean(dim=1).sum() * MTP_SCALE / ids.shape[0]


@pytest.mark.parametrize("case", _ids([c for c in CASES if c.mtp_reference]))
def test_mtp_loss_and_grads_match_the_reference(checkpoint, case):
    """float64, 2 x 13 tokens: depth-1 MTP logits, the MTP loss and every grad of it against the case's reference;
    every MTP tensor of the family's mtp_names gets a grad (the indexers run without grad; the expert bias is a
    buffer)."""
    ckpt = checkpoint(case)
    reference = resolve_hook(case.mtp_reference)(case, ckpt)
    model = load_hf_model(ckpt, dtype=torch.float64, load_mtp=True)
    ids, pos = random_batch(2, 13, VOCAB, 7)
    ref_logits = reference(ids)
    logits, (ours,) = model(ids, pos, mtp_logits=True)
    assert logits.shape == ours.shape
    assert rel_max(ours, ref_logits) <= case.mtp_logits_tol, rel_max(ours, ref_logits)
    ref_loss, (_, loss) = _mtp_loss_reference(ref_logits, ids), main_and_mtp_losses(logits, ours, ids)
    assert abs(float(loss.detach()) - float(ref_loss.detach())) <= 1e-6 * abs(float(ref_loss.detach()))
    assert float(ref_loss.detach()) > 1.0
    ref_loss.backward()
    loss.backward()
    want = reference.grads()
    mtp_names, aliases = model.family.call("mtp_names", model.arch)
    assert set(mtp_names) <= want.keys() and aliases == {}
    got = megatron_grads_by_hf_name(model)
    for name, ref in want.items():
        grad = got.get(name)
        if ref is None or grad is None:  # the indexers run without grad (transformers' and ours), the expert bias
            assert (".indexer." in name or "e_score" in name) and (grad is None or not grad.any()) \
                and (ref is None or not ref.any()), name
            continue
        assert float((grad - ref).abs().max()) <= case.mtp_grad_tol * float(ref.abs().max()) + 1e-12, name
    assert all(got[n].abs().sum() > 0 for n in mtp_names if n.endswith("eh_proj.weight"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", _ids([c for c in CASES if c.mtp_layouts]))
def test_mtp_layouts_equal_the_single_rank(checkpoint, case, tmp_path):
    """The case's MTP layouts (tests/mtp_layouts_worker.py) against this process's float32 run of the same batch:
    2 x 12 tokens (12 % tp == 0 for sequence parallel, % (2 * cp) == 0; > index_topk + kpool - 1 = 11: DSA drops
    keys)."""
    from glm5_helpers import spawn_ranks
    from mtp_layouts_worker import forward_backward_single, run

    ckpt = checkpoint(case)
    ids, pos = random_batch(2, 12, VOCAB, 3)
    model = load_hf_model(ckpt, load_mtp=True)
    export = [(n, t.clone()) for bucket in export_hf(model) for n, t in bucket]
    single = forward_backward_single(model, ids, pos)
    assert single["mtp_loss"] > 1.0 and single["loss"] > 1.0
    torch.save(dict(ids=ids, pos=pos, grads=megatron_grads_by_hf_name(model), export=export, **single),
               tmp_path / "ref.pt")
    spawn_ranks(run, 2, ckpt, str(tmp_path / "ref.pt"), list(case.mtp_layouts))
