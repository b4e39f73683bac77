"""Worker of tests/test_model_families_parallel.py (2 processes over gloo). Imported by torch.multiprocessing spawn."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _moved_weights(model) -> dict[str, torch.Tensor]:
    """Shift every parameter by a seeded amount (the same on every rank); the export afterwards (full HF tensors)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    from slime.backends.megatron import export_hf

    return {n: t.clone() for bucket in export_hf(model) for n, t in bucket}


def _context_parallel(ckpt: str, ref: dict) -> None:
    """CP2: the batch's rows packed as sequences, each rank's chunks through megatron DDP; logits gathered back to
    sequence order within 1e-5 of transformers, grads after DDP's DP x CP reduction within 1e-5 of its grads."""
    from glm5_helpers import megatron_grads_by_hf_name
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, init_parallel, load_hf_model
    from slime_plugins.models.common.context_parallel import build_layout, gather_sequence
    from slime_plugins.models.common.rope import ContextParallelSeqParams

    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    batch, seq = ids.shape
    init_parallel(1, 1, 1, cp=2)
    from megatron.core import parallel_state as ps

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
    grads = megatron_grads_by_hf_name(ddp.module, gather=lambda g, kind: [g])
    assert grads.keys() == ref["grads"].keys(), "cp2: grad names"
    for name, g in ref["grads"].items():
        err = float((grads[name] - g).abs().max())
        assert err <= ref.get("grad_tol", 1e-5) * float(g.abs().max()) + 1e-7, f"cp2: grad {name} off by {err}"
    init_parallel(1, 1, 1)


def run(rank: int, port: int, cases: list[tuple[str, str, str, list]], save_root: str) -> None:
    """cases: (model_type, checkpoint dir, reference file, [(tp, ep) or "pp2", ...]). The first layout also
    writes a torch_dist checkpoint of shifted weights; every later (tp, ep) layout loads it resharded and
    must export them. "pp2": megatron's pipeline schedule over 2 stages (tests/glm5_parallel_worker.py)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from glm5_helpers import megatron_grads_by_hf_name
    from glm5_parallel_worker import _pipeline_parallel, check_tensor_parallel_attributes
    from safetensors.torch import load_file
    from slime.backends.megatron import build_optimizer, export_hf, load_hf_model
    from slime.backends.megatron import checkpoint as C
    from slime_plugins.models.common import weights as W

    for model_type, ckpt, ref_path, layouts in cases:
        ref = torch.load(ref_path)
        ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
        original = load_file(os.path.join(ckpt, "model.safetensors"))
        base_norm = saved = None
        root = os.path.join(save_root, model_type)
        for layout in layouts:
            if layout == "pp2":
                _pipeline_parallel(rank, ckpt, ref, original, ref["logits"])
                continue
            if layout == "cp2":
                _context_parallel(ckpt, ref)
                continue
            tp, ep = layout
            where = f"{model_type} tp={tp} ep={ep}"
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
            grads = megatron_grads_by_hf_name(ddp.module, gather=lambda g, kind, ep_group=ep_group, tp_group=tp_group: [g] if kind == W.REPLICATED else _gather(
                g, ep_group if kind in (W.EXPERT_W1, W.EXPERT_W2) else tp_group))
            assert grads.keys() == ref["grads"].keys(), f"{where}: grad names"
            for name, g in ref["grads"].items():
                err = float((grads[name] - g).abs().max())
                assert err <= ref.get("grad_tol", 1e-5) * float(g.abs().max()) + 1e-7, f"{where}: grad {name} off by {err}"
            exported = {n: t for bucket in export_hf(ddp, bucket_bytes=1 << 14) for n, t in bucket}
            assert exported.keys() == original.keys()
            bad = [n for n in original if not torch.equal(exported[n].cpu(), original[n])]
            assert not bad, f"{where}: export differs for {bad[:3]}"
            check_tensor_parallel_attributes(ddp.module, tp, ep)
            ok, grad_norm, _ = opt.step()
            assert ok and grad_norm > 0
            norms = _gather(torch.tensor([float(grad_norm)], dtype=torch.float64), None)
            assert norms[0] == norms[1], f"{where}: the ranks report different grad norms {norms}"
            base_norm = base_norm or float(grad_norm)
            assert abs(float(grad_norm) - base_norm) <= 1e-5 * base_norm, f"{where}: grad norm {grad_norm} != {base_norm}"
            # torch_dist: written at the first layout, loaded (resharded) at the others, the same HF tensors.
            model = load_hf_model(ckpt, tp=tp, ep=ep)
            if saved is None:
                ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
                saved = _moved_weights(model)
                C.save(root, 0, ddp, opt, rank, {"world_size": 2, "tp": tp, "ep": ep, "pp": 1}, {})
                continue
            C.load_model_weights(root, model)
            loaded = {n: t for bucket in export_hf(model) for n, t in bucket}
            assert loaded.keys() == saved.keys()
            bad = [n for n in saved if not torch.equal(loaded[n].cpu(), saved[n].cpu())]
            assert not bad, f"{where}: torch_dist checkpoint of another layout loads differently for {bad[:3]}"
    tied_needs_one_stage(cases)
    dist.barrier()
    dist.destroy_process_group()


def tied_needs_one_stage(cases) -> None:
    """A checkpoint with tied embeddings asked for pp=2: one clear error, on every rank."""
    import pytest

    from slime.backends.megatron import load_hf_model

    tied = [ckpt for model_type, ckpt, _, _ in cases if model_type == "qwen3"]
    if not tied:  # a run without a tied checkpoint (tests/test_qwen3_next_parallel.py)
        return
    with pytest.raises(ValueError, match="tie_word_embeddings=True needs the embedding and the output layer on one stage"):
        load_hf_model(tied[0], pp=2)
