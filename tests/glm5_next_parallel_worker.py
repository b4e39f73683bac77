"""Worker of the glm5_next multi-rank tests (2 processes over gloo): each layout's logits and reduced grads
against the single-process reference saved by the test. Imported by tests/rank_spawn.py's fork server."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _forward_backward(ddp, ids, pos, weight):
    """Logits (last stage; None elsewhere) after one forward / backward through megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen = {}

    def forward_step(data_iterator, model):
        def loss_func(logits):
            seen["logits"] = logits.detach()
            return (logits * weight).sum(), {}

        return model(ids, pos), loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    return seen.get("logits")


LAYOUTS = {"dp2": (1, 1, 1), "tp2": (2, 1, 1), "ep2": (1, 2, 1), "pp2": (1, 1, 2)}  # (tp, ep, pp); cp2 below


def run(rank: int, world: int, port: int, ckpt: str, ref_path: str, layouts: list) -> None:
    from glm5_helpers import init_rank
    from glm5_parallel_worker import check_tensor_parallel_attributes
    from glm5_next_helpers import grads_by_hf_name
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, load_hf_model
    from slime_plugins.models.common import weights as W

    init_rank(rank, world, port)
    ref = torch.load(ref_path)
    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    grad_norms: dict[str, float] = {}
    for name in layouts:
        if name == "cp2":  # the conformance suite's runner: the rows' chunks over 2 CP ranks, logits gathered back
            from model_conformance_worker import _context_parallel

            _context_parallel(ckpt, ref)
            continue
        tp, ep, pp = LAYOUTS[name]
        model = load_hf_model(ckpt, tp=tp, ep=ep, pp=pp)
        ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
        ddp.zero_grad_buffer()
        logits = _forward_backward(ddp, ids, pos, weight)
        finalize_model_grads([ddp])
        if ps.is_pipeline_last_stage():
            rel = float((logits - ref["logits"]).abs().max() / ref["logits"].abs().max())
            assert rel < 1e-5, f"{name}: logits {rel:.2e} from the reference"
        for p in ddp.module.parameters():
            if p.requires_grad:
                p.grad = p.main_grad
        experts = ps.get_expert_model_parallel_group()

        def gather(g, kind, experts=experts):
            if kind == W.REPLICATED:
                return [g]
            return _gather(g, experts if kind in (W.EXPERT_W1, W.EXPERT_W2) else ps.get_tensor_model_parallel_group())

        grads = grads_by_hf_name(ddp.module, gather)
        assert len(grads) > 20, f"{name}: {len(grads)} grads"
        for hf_name, g in grads.items():
            want = ref["grads"].get(hf_name)
            if want is None:  # no grad in the single process (the indexer runs without grad): DDP's stays zero
                assert not g.any(), f"{name}: {hf_name} has a grad"
                continue
            assert float((g - want).abs().max()) <= ref["grad_tol"] * float(want.abs().max()) + 1e-7, f"{name}: {hf_name}"
        check_tensor_parallel_attributes(ddp.module, tp, ep)  # else megatron's grad norm counts shards wrongly
        ok, grad_norm, _ = opt.step()  # megatron's own grad norm: the same on both ranks and at every layout
        norms = _gather(torch.tensor([float(grad_norm)], dtype=torch.float64), None)
        assert ok and norms[0] == norms[1], f"{name}: grad norms {norms}"
        base = grad_norms.setdefault("first", float(grad_norm))
        assert abs(float(grad_norm) - base) <= 1e-5 * base, f"{name}: grad norm {grad_norm} != {base}"
    dist.barrier()
    dist.destroy_process_group()
