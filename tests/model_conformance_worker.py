"""Rank processes of tests/test_model_conformance.py's layout test (2 processes over gloo, tests/rank_spawn.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# layout -> (tp, ep) of the single-model layouts; cp2 and pp2 have runners of their own
TP_EP = {"dp2": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _check_grads(grads: dict, ref: dict, where: str) -> None:
    assert grads.keys() == ref["grads"].keys(), f"{where}: grad names"
    for name, g in ref["grads"].items():
        err = float((grads[name] - g).abs().max())
        assert err <= ref["grad_tol"] * float(g.abs().max()) + 1e-7, f"{where}: grad {name} off by {err}"


def _moved_weights(model) -> dict[str, torch.Tensor]:
    """Shift every parameter by a seeded amount (the same on every rank); the export afterwards (full HF tensors)."""
    from slime.backends.megatron import export_hf

    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return {n: t.clone() for bucket in export_hf(model) for n, t in bucket}


def _context_parallel(ckpt: str, ref: dict) -> None:
    """CP2: the batch's rows packed as sequences, each rank's chunks through megatron DDP; logits gathered back to
    sequence order within 1e-5 of transformers, grads after DDP's DP x CP reduction within the case's bound."""
    from glm5_helpers import megatron_grads_by_hf_name
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, init_parallel, load_hf_model
    from slime_plugins.models.common.context_parallel import build_layout, gather_sequence
    from slime_plugins.models.common.rope import ContextParallelSeqParams

    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    batch, seq = ids.shape
    init_parallel(1, 1, 1, cp=2)
    model = load_hf_model(ckpt)
    ddp, _ = build_optimizer(model, lr=1e-3, clip_grad=0.0)
    ddp.zero_grad_buffer()
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    layout = build_layout(cu, 2, ps.get_context_parallel_rank(), ps.get_context_parallel_group())
    local_cu = layout.cu_seqlens_q
    packed = ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=local_cu, cu_seqlens_kv=local_cu,
                                      context_parallel=layout)
    local = layout.local_index
    logits = ddp(ids.reshape(1, -1)[:, local], pos.reshape(1, -1)[:, local], packed_seq_params=packed)
    logits = gather_sequence(logits[0], layout).view(batch, seq, -1)
    (logits * weight).sum().backward()  # every CP rank: the whole loss; the gather sums both copies' grads
    finalize_model_grads([ddp])  # averaged over DP x CP
    assert _rel(logits.detach(), ref["logits"]) <= 1e-5, "cp2: logits"
    for p in ddp.module.parameters():
        if p.requires_grad:
            p.grad = p.main_grad
    _check_grads(megatron_grads_by_hf_name(ddp.module, gather=lambda g, kind: [g]), ref, "cp2")
    init_parallel(1, 1, 1)


def _tied_needs_one_stage(ckpt: str) -> None:
    """A checkpoint with tied embeddings asked for pp=2: one clear error, on every rank."""
    import pytest

    from slime.backends.megatron import load_hf_model

    with pytest.raises(ValueError, match="tie_word_embeddings=True needs the embedding and the output layer on one stage"):
        load_hf_model(ckpt, pp=2)


def _mtp_logits(ckpt: str, tp: int, ep: int, ref: dict, where: str) -> None:
    """The MTP layer's depth-1 logits at this layout equal the reference's (1e-5; the last row has no token t + 1)."""
    from slime.backends.megatron import load_hf_model

    model = load_hf_model(ckpt, tp=tp, ep=ep, load_mtp=True)
    with torch.no_grad():
        _, (mtp1,) = model(ref["ids"], ref["pos"], mtp_logits=True)
    assert _rel(mtp1[:, :-1], ref["mtp_logits"][:, :-1]) <= 1e-5, f"{where}: MTP logits"


def _model_parallel(layout: str, name: str, ckpt: str, ref: dict, original: dict, state: dict) -> None:
    """tp2 / ep2 / dp2 through megatron DDP: logits, reduced grads, export on every rank, tensor-parallel attributes,
    equal grad norms on both ranks and across layouts; then the torch_dist checkpoint: written at the first such
    layout (of shifted weights), loaded resharded at every later one to the same HF tensors."""
    from glm5_helpers import megatron_grads_by_hf_name
    from glm5_parallel_worker import check_tensor_parallel_attributes
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, export_hf, load_hf_model
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime_plugins.models.common import weights as W

    tp, ep = TP_EP[layout]
    where = f"{name} {layout}"
    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    model = load_hf_model(ckpt, tp=tp, ep=ep)
    ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
    ddp.zero_grad_buffer()
    logits = ddp(ids, pos)
    (logits * weight).sum().backward()
    finalize_model_grads([ddp])
    assert _rel(logits.detach(), ref["logits"]) <= 1e-5, f"{where}: logits"
    for p in ddp.module.parameters():
        if p.requires_grad:
            p.grad = p.main_grad
    ep_group, tp_group = ps.get_expert_model_parallel_group(), ps.get_tensor_model_parallel_group()

    def gather(g, kind):
        if kind == W.REPLICATED:
            return [g]
        return _gather(g, ep_group if kind in (W.EXPERT_W1, W.EXPERT_W2) else tp_group)

    _check_grads(megatron_grads_by_hf_name(ddp.module, gather=gather), ref, where)
    exported = {n: t for bucket in export_hf(ddp, bucket_bytes=1 << 14) for n, t in bucket}
    assert exported.keys() == original.keys(), f"{where}: exported names"
    bad = [n for n in original if not torch.equal(exported[n].cpu(), original[n])]
    assert not bad, f"{where}: export differs for {bad[:3]}"
    check_tensor_parallel_attributes(ddp.module, tp, ep)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0
    norms = _gather(torch.tensor([float(grad_norm)], dtype=torch.float64), None)
    assert norms[0] == norms[1], f"{where}: the ranks report different grad norms {norms}"
    base = state.setdefault("grad_norm", float(grad_norm))
    assert abs(float(grad_norm) - base) <= 1e-5 * base, f"{where}: grad norm {grad_norm} != {base}"
    if "mtp_logits" in ref:
        _mtp_logits(ckpt, tp, ep, ref, where)
    model = load_hf_model(ckpt, tp=tp, ep=ep)
    if "saved" not in state:
        ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
        state["saved"] = _moved_weights(model)
        C.save(state["root"], 0, ddp, opt, dist.get_rank(), {"world_size": 2, "tp": tp, "ep": ep, "pp": 1}, {})
        return
    C.load_model_weights(state["root"], model)
    loaded = {n: t for bucket in export_hf(model) for n, t in bucket}
    assert loaded.keys() == state["saved"].keys(), f"{where}: torch_dist names"
    bad = [n for n in state["saved"] if not torch.equal(loaded[n].cpu(), state["saved"][n].cpu())]
    assert not bad, f"{where}: torch_dist checkpoint of another layout loads differently for {bad[:3]}"


def run(rank: int, port: int, name: str, ckpt: str, ref_path: str, layouts: tuple, save_root: str) -> None:
    """Every layout of one case in order (tests/test_model_conformance.py::test_layouts_match_transformers)."""
    import json

    from safetensors.torch import load_file

    from glm5_parallel_worker import _pipeline_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    ref = torch.load(ref_path)
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    tied = json.load(open(os.path.join(ckpt, "config.json"))).get("tie_word_embeddings", False)
    state = {"root": os.path.join(save_root, name)}
    for layout in layouts:
        if layout == "pp2" and tied:
            _tied_needs_one_stage(ckpt)
        elif layout == "pp2":
            _pipeline_parallel(rank, ckpt, ref, original, ref["logits"])
        elif layout == "cp2":
            _context_parallel(ckpt, ref)
        else:
            _model_parallel(layout, name, ckpt, ref, original, state)
    dist.barrier()
    dist.destroy_process_group()
