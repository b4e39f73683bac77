"""Worker of tests/test_glm5_next_mtp.py (2 processes over gloo): a glm5_next model with its MTP layer at tp2 / pp2
against the single process (logits, MTP logits, grads through megatron's schedule), and export_hf(all_stages=True)
on every rank against the single process's export. Imported by tests/rank_spawn.py's fork server."""

from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 1, 2)}  # (tp, ep, pp)


def _weights(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed weights of the loss sum(logits * w) + sum(mtp_logits * w_mtp)."""
    g = torch.Generator().manual_seed(12)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _loss(out, shape):
    logits, (mtp,) = out
    w, w_mtp = _weights(shape)
    return (logits * w).sum() + (mtp * w_mtp).sum()


def forward_backward_single(model, ids, pos) -> tuple[torch.Tensor, torch.Tensor]:
    """The single process: (logits, MTP logits) after backward of the loss."""
    out = model(ids, pos, mtp_logits=True)
    _loss(out, tuple(out[0].shape)).backward()
    return out[0].detach(), out[1][0].detach()


def _forward_backward(ddp, ids, pos) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen = {}

    def forward_step(data_iterator, model):
        def loss_func(out):
            seen["logits"], seen["mtp"] = out[0].detach(), out[1][0].detach()
            return _loss(out, tuple(out[0].shape)), {}

        return model(ids, pos, mtp_logits=True), loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    return seen


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _check_export(model, ref, name: str) -> None:
    from slime.backends.megatron import export_hf

    got = [(n, t.detach().cpu().clone()) for bucket in export_hf(model, bucket_bytes=1 << 14, all_stages=True)
           for n, t in bucket]
    assert [n for n, _ in got] == [n for n, _ in ref["export"]], f"{name}: exported names or order differ"
    differ = [n for (n, t), (_, want) in zip(got, ref["export"]) if t.dtype != want.dtype or not torch.equal(t, want)]
    assert differ == [], f"{name}: {differ[:4]}"


def _check_grads(ddp, ref, name: str) -> None:
    from glm5_next_helpers import grads_by_hf_name
    from megatron.core import parallel_state as ps

    from slime_plugins.models.common import weights as W

    for p in ddp.module.parameters():
        if p.requires_grad:
            p.grad = p.main_grad
    experts = ps.get_expert_model_parallel_group()

    def gather(g, kind):
        if kind == W.REPLICATED:
            return [g]
        return _gather(g, experts if kind in (W.EXPERT_W1, W.EXPERT_W2) else ps.get_tensor_model_parallel_group())

    grads = grads_by_hf_name(ddp.module, gather)
    if ps.is_pipeline_last_stage():
        assert any(".layers.5." in n for n in grads), f"{name}: no MTP grads on the last stage"
    for hf_name, g in grads.items():
        want = ref["grads"].get(hf_name)
        if want is None:
            assert not g.any(), f"{name}: {hf_name} has a grad"
            continue
        assert float((g - want).abs().max()) <= 5e-5 * float(want.abs().max()) + 1e-7, f"{name}: {hf_name}"


def run(rank: int, world: int, port: int, ckpt: str, ref_path: str, layouts: list) -> None:
    from glm5_helpers import init_rank
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, load_hf_model

    init_rank(rank, world, port)
    ref = torch.load(ref_path)
    for name in layouts:
        tp, ep, pp = LAYOUTS[name]
        model = load_hf_model(ckpt, tp=tp, ep=ep, pp=pp, load_mtp=True)
        assert (getattr(model, "mtp", None) is not None) == ps.is_pipeline_last_stage(), name
        _check_export(model, ref, name)
        ddp, _ = build_optimizer(model, lr=1e-3, clip_grad=0.0)
        ddp.zero_grad_buffer()
        seen = _forward_backward(ddp, ids=ref["ids"], pos=ref["pos"])
        finalize_model_grads([ddp])  # sums the two embedding copies' grads (MTP under PP)
        if ps.is_pipeline_last_stage():
            for key in ("logits", "mtp"):
                rel = float((seen[key] - ref[key]).abs().max() / ref[key].abs().max())
                assert rel < 1e-5, f"{name}: {key} {rel:.2e} from the single process"
        _check_grads(ddp, ref, name)
    dist.barrier()
    dist.destroy_process_group()
