"""Rank processes of tests/test_model_conformance.py's MTP layout test (2 processes over gloo, tests/rank_spawn.py): a
model with its MTP layer at tp2 / ep2 / pp2 / cp2 against the single process: the main loss and the MTP loss
(model_conformance.main_and_mtp_losses), the logits and the MTP logits, and the grads of the two losses' sum (every
parameter, the MTP layer's included); tp2 / ep2 / pp2 through megatron's schedule, cp2 with each rank's chunks
through megatron DDP and the MTP inputs one token ahead taken from the whole pack (as the trainer's forward takes
them: data.tokens_ahead); and export_hf(all_stages=True) on every rank against the single process's export."""

from __future__ import annotations

import torch
import torch.distributed as dist
from model_conformance import main_and_mtp_losses

LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "pp2": (1, 1, 2), "cp2": (1, 1, 1)}  # (tp, ep, pp); cp2: cp = 2
# float32. Grads: per tensor within 5e-5 of its max |grad| (+ 1e-7): the reductions run in another order (TP /
# EP / CP partial sums, GLM-5.3-Flash's mHC base / scale grads summed over every token and stream). Logits 1e-5 of
# max |logit|. Losses 1e-6 relative (float32 rounding of the logits' last bits in a mean of cross entropies).
GRAD_TOL = 5e-5


def forward_backward_single(model, ids, pos) -> dict:
    """The single process: logits, MTP logits and both losses, after backward of their sum."""
    logits, (mtp,) = model(ids, pos, mtp_logits=True)
    main, extra = main_and_mtp_losses(logits, mtp, ids)
    (main + extra).backward()
    return dict(logits=logits.detach(), mtp=mtp.detach(), loss=float(main.detach()), mtp_loss=float(extra.detach()))


def _forward_backward(ddp, ids, pos) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen = {}

    def forward_step(data_iterator, model):
        def loss_func(out):
            logits, (mtp,) = out
            main, extra = main_and_mtp_losses(logits, mtp, ids)
            seen.update(logits=logits.detach(), mtp=mtp.detach(), loss=float(main.detach()), mtp_loss=float(extra.detach()))
            return main + extra, {}

        return model(ids, pos, mtp_logits=True), loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    return seen


def _context_parallel_forward_backward(ddp, ids, pos) -> dict:
    """CP2: the rows packed as sequences, this rank's chunks through the model with the MTP inputs one token ahead
    from the whole pack; logits gathered back to sequence order, the whole loss on every CP rank (the gather's
    backward sums both copies' grads; finalize_model_grads averages them over DP x CP)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from slime.backends.megatron.data import tokens_ahead
    from slime_plugins.models.common.context_parallel import build_layout, gather_sequence
    from slime_plugins.models.common.rope import ContextParallelSeqParams

    batch, seq = ids.shape
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    layout = build_layout(cu, 2, ps.get_context_parallel_rank(), ps.get_context_parallel_group())
    local_cu = layout.cu_seqlens_q
    packed = ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=local_cu, cu_seqlens_kv=local_cu,
                                      context_parallel=layout)
    flat, local = ids.reshape(1, -1), layout.local_index
    ahead = tokens_ahead(SimpleNamespace(tokens=flat, cu_seqlens=cu), 1)
    logits, (mtp,) = ddp(flat[:, local], pos.reshape(1, -1)[:, local], packed_seq_params=packed, mtp_logits=True,
                         mtp_input_ids=[ahead[:, local]])
    logits, mtp = (gather_sequence(x[0], layout).view(batch, seq, -1) for x in (logits, mtp))
    main, extra = main_and_mtp_losses(logits, mtp, ids)
    (main + extra).backward()
    return dict(logits=logits.detach(), mtp=mtp.detach(), loss=float(main.detach()), mtp_loss=float(extra.detach()))


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
    from glm5_helpers import megatron_grads_by_hf_name
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

    grads = megatron_grads_by_hf_name(ddp.module, gather)
    if ps.is_pipeline_last_stage():
        assert any(W.is_mtp_layer_name(ddp.module.arch, n) for n in grads), f"{name}: no MTP grads on the last stage"
    if ps.get_pipeline_model_parallel_world_size() == 1:  # one stage holds every parameter
        missing = {n for n, g in ref["grads"].items() if g is not None} - grads.keys()
        assert not missing, f"{name}: no grad for {sorted(missing)[:4]}"
    worst = (0.0, "")
    for hf_name, g in grads.items():
        want = ref["grads"].get(hf_name)
        if want is None:
            assert not g.any(), f"{name}: {hf_name} has a grad"
            continue
        err, bound = float((g - want).abs().max()), GRAD_TOL * float(want.abs().max()) + 1e-7
        assert err <= bound, f"{name}: {hf_name} off by {err:.3g} (bound {bound:.3g})"
        worst = max(worst, (err / bound, hf_name))
    print(f"{name}: grads at most {worst[0]:.2f} of their bound ({worst[1]})", flush=True)


def run(rank: int, world: int, port: int, ckpt: str, ref_path: str, layouts: list) -> None:
    from glm5_helpers import init_rank
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron import build_optimizer, init_parallel, load_hf_model

    init_rank(rank, world, port)
    ref = torch.load(ref_path)
    for name in layouts:
        tp, ep, pp = LAYOUTS[name]
        if name == "cp2":
            init_parallel(1, 1, 1, cp=2)
        model = load_hf_model(ckpt, tp=tp, ep=ep, pp=pp, load_mtp=True)
        assert (getattr(model, "mtp", None) is not None) == ps.is_pipeline_last_stage(), name
        _check_export(model, ref, name)
        ddp, _ = build_optimizer(model, lr=1e-3, clip_grad=0.0)
        ddp.zero_grad_buffer()
        if name == "cp2":
            seen = _context_parallel_forward_backward(ddp, ids=ref["ids"], pos=ref["pos"])
        else:
            seen = _forward_backward(ddp, ids=ref["ids"], pos=ref["pos"])
        finalize_model_grads([ddp])  # sums the two embedding copies' grads (MTP under PP); averages over DP x CP
        if ps.is_pipeline_last_stage():
            for key in ("logits", "mtp"):
                rel = float((seen[key] - ref[key]).abs().max() / ref[key].abs().max())
                assert rel < 1e-5, f"{name}: {key} {rel:.2e} from the single process"
            for key in ("loss", "mtp_loss"):
                rel = abs(seen[key] - ref[key]) / abs(ref[key])
                assert rel <= 1e-6, f"{name}: {key} {seen[key]} vs {ref[key]} ({rel:.2e})"
                print(f"{name}: {key} rel {rel:.2e}", flush=True)
        _check_grads(ddp, ref, name)
        if name == "cp2":
            init_parallel(1, 1, 1)
    dist.barrier()
    dist.destroy_process_group()
