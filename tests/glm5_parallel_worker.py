"""Worker of tests/test_glm5_parallel.py (2 processes over gloo). Imported by torch.multiprocessing spawn."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


_ACTIVE = []  # keeps the simulator's context manager alive for the whole worker


def _use_accelerator(name: str) -> None:
    if name == "npu-sim":
        import npu_sim

        from slime.accelerator import set_accelerator

        _ACTIVE.append(npu_sim.activate())
        set_accelerator(_ACTIVE[-1].__enter__())


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def run(rank: int, port: int, accel: str, ckpt: str, ref_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    _use_accelerator(accel)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from glm5_helpers import megatron_grads_by_hf_name
    from safetensors.torch import load_file
    from slime.backends.megatron import build_optimizer, export_hf, load_hf_model
    from slime_plugins.models.common import weights as W

    ref = torch.load(ref_path)
    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    base = base_norm = None
    for tp, ep in [(1, 1), (2, 1), (1, 2)]:
        model = load_hf_model(ckpt, tp=tp, ep=ep, load_mtp=True)
        assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_expert_model_parallel_world_size() == ep
        ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
        ddp.zero_grad_buffer()
        logits, (mtp,) = ddp(ids, pos, mtp_logits=True)
        (logits * weight).sum().backward()
        finalize_model_grads([ddp])
        if base is None:
            base, base_mtp = logits.detach(), mtp.detach()
        torch.testing.assert_close(mtp.detach(), base_mtp, rtol=1e-5, atol=1e-5, msg=f"tp={tp} ep={ep} MTP logits")
        # Logits: TP / EP sharding must not change them (vs tp = ep = 1), and all match transformers.
        torch.testing.assert_close(logits.detach(), base, rtol=1e-5, atol=1e-5, msg=f"tp={tp} ep={ep} vs tp=1")
        torch.testing.assert_close(logits.detach(), ref["logits"], rtol=1e-4, atol=2e-4)
        # Grads after megatron's reduction (sequence-parallel norms/router over TP, experts over EDP).
        for p in ddp.module.parameters():
            if p.requires_grad:
                p.grad = p.main_grad
        groups = {W.EXPERT_W1: ps.get_expert_model_parallel_group(), W.EXPERT_W2: ps.get_expert_model_parallel_group()}
        grads = megatron_grads_by_hf_name(
            ddp.module, gather=lambda g, kind, groups=groups: [g] if kind == W.REPLICATED else _gather(g, groups.get(kind, ps.get_tensor_model_parallel_group())))
        if os.environ.get("GLM5_DEBUG"):
            for name, g in ref["grads"].items():
                d = (grads[name] - g).abs().max().item()
                if d > 1e-4 + 1e-3 * float(g.abs().max()):
                    print(rank, tp, ep, name, d, g.abs().max().item(), (grads[name].abs().max()).item(), flush=True)
        for name, g in ref["grads"].items():
            tol = 1e-4 + 1e-3 * float(g.abs().max())
            torch.testing.assert_close(grads[name], g, rtol=0, atol=tol, msg=f"tp={tp} ep={ep} grad {name}")
        # Export gathers the shards back into the exact checkpoint tensors, on every rank.
        exported = {n: t for bucket in export_hf(ddp, bucket_bytes=1 << 16) for n, t in bucket}
        assert exported.keys() == original.keys()
        bad = [n for n in original if not torch.equal(exported[n].cpu(), original[n])]
        assert not bad, f"tp={tp} ep={ep}: export differs for {bad[:3]}"
        check_tensor_parallel_attributes(ddp.module, tp, ep)
        # Megatron's own grad norm (optimizer step, float32): every layout and every rank must report the
        # single-rank value (TP shards counted on every TP rank, replicated params once).
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        norms = _gather(torch.tensor([float(grad_norm)], dtype=torch.float64), None)
        assert norms[0] == norms[1], f"tp={tp} ep={ep}: the ranks report different grad norms {norms}"
        if base_norm is None:
            base_norm = float(grad_norm)
        assert abs(float(grad_norm) - base_norm) <= 1e-5 * base_norm, f"tp={tp} ep={ep}: grad norm {grad_norm} != {base_norm}"
    _pipeline_parallel(rank, ckpt, ref, original, base)
    expert_parallel_rank_without_tokens(rank, ckpt, ref)
    gpt_moe_expert_parallel(rank)
    distributed_optimizer_matches_plain(ckpt, ref)
    dist.barrier()
    dist.destroy_process_group()


def check_tensor_parallel_attributes(model, tp: int, ep: int) -> None:
    """Every TP shard (by its weight map) carries megatron's tensor-parallel attributes with the split
    dim; replicated parameters carry none; expert weights are marked (expert-TP shards, as megatron's)."""
    from slime_plugins.models.common import weights as W

    split = {W.TP_ROWS: (0, 1), W.TP_GATE_UP: (0, 2), W.TP_GATE_UP_FUSED: (0, 2), W.TP_COLS: (1, 1), W.EXPERT_W1: (2, 2), W.EXPERT_W2: (1, 1)}
    params = dict(model.named_parameters())
    checked = 0
    for m in model.family.call("weight_maps", model):
        p = params.get(m.param)
        if p is None:  # a buffer (expert bias)
            continue
        checked += 1
        if m.kind in split:
            got = (getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                   getattr(p, "partition_stride", None))
            assert got == (True, *split[m.kind]), f"tp={tp} ep={ep}: {m.param} ({m.kind}) has {got}"
        else:
            assert not getattr(p, "tensor_model_parallel", False), f"tp={tp} ep={ep}: replicated {m.param} is marked"
    assert checked == len(params), "every parameter has a weight map"


def _pipeline_parallel(rank, ckpt, ref, original, base) -> None:
    """pp=2 through megatron's pipeline schedule: last-stage logits, every stage's reduced grads, the
    stage's export, and save_hf assembling both stages (plus the passed-through MTP layer)."""
    import tempfile

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from glm5_helpers import megatron_grads_by_hf_name
    from safetensors.torch import load_file
    from slime.backends.megatron import build_optimizer, export_hf, load_hf_model, save_hf

    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    model = load_hf_model(ckpt, pp=2)
    assert ps.get_pipeline_model_parallel_world_size() == 2
    ddp, opt = build_optimizer(model, lr=1e-3, clip_grad=0.0)
    ddp.zero_grad_buffer()
    seen = {}

    def forward_step(data_iterator, m):
        out = m(ids, pos)

        def loss_func(t):
            seen["logits"] = t.detach()
            return (t * weight).sum(), {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    finalize_model_grads([ddp])
    if ps.is_pipeline_last_stage():
        torch.testing.assert_close(seen["logits"], base, rtol=1e-5, atol=1e-5, msg="pp=2 logits")
    for p in ddp.module.parameters():
        if p.requires_grad:
            p.grad = p.main_grad
    grads = megatron_grads_by_hf_name(ddp.module)
    assert len(grads) > 10
    for name, g in grads.items():
        want = ref["grads"][name]
        tol = 1e-4 + 1e-3 * float(want.abs().max())
        torch.testing.assert_close(g, want, rtol=0, atol=tol, msg=f"pp=2 stage {rank} grad {name}")
    exported = {n: t for bucket in export_hf(ddp) for n, t in bucket}
    assert exported and all(torch.equal(t.cpu(), original[n]) for n, t in exported.items())
    out = os.path.join(tempfile.gettempdir(), f"slime-pp-save-{os.getppid()}")
    save_hf(ddp, out)
    if rank == 0:
        saved = {}
        for fn in os.listdir(out):
            if fn.endswith(".safetensors"):
                saved.update(load_file(os.path.join(out, fn)))
        assert saved.keys() == original.keys() and all(torch.equal(saved[n], original[n]) for n in original)
        import shutil

        shutil.rmtree(out)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0


def expert_parallel_rank_without_tokens(rank: int, ckpt: str, ref) -> None:
    """ep=2 with the expert bias steering every token to experts 0..E/2-1 (EP rank 0): EP rank 1 receives
    no rows in forward or backward. Logits and the non-expert grads equal ep=1; rank 1's expert grads are
    0 and rank 0's are twice ep=1's (both ranks run the same batch through rank 0's experts)."""
    from slime.backends.megatron import load_hf_model
    from slime_plugins.models.common.moe import MoELayer

    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    runs = []
    for ep in (1, 2):
        model = load_hf_model(ckpt, ep=ep)
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.expert_bias[: m.arch.n_routed_experts // 2] += 10.0
        logits = model(ids, pos)
        (logits * weight).sum().backward()
        runs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (logits_1, grads_1), (logits_2, grads_2) = runs
    torch.testing.assert_close(logits_2, logits_1, rtol=1e-5, atol=1e-5, msg="ep=2 with an idle rank: logits")
    assert grads_2.keys() == grads_1.keys()
    for name, g in grads_2.items():
        assert g is not None and torch.isfinite(g).all(), f"ep=2 with an idle rank: grad {name}"
        if ".experts." in name and rank == 1:
            assert (g == 0).all(), f"EP rank 1 received no tokens, yet {name} has a gradient"
            continue
        want = grads_1[name] if ".experts." not in name else 2 * grads_1[name][: g.shape[0]]
        err, tol = (g - want).abs().max().item(), 1e-5 * max(1.0, want.abs().max().item())  # float32 sums, other order
        assert err <= tol, f"ep=2 with an idle rank, rank {rank}: grad {name} differs by {err:.3g} (> {tol:.3g})"


def gpt_moe_expert_parallel(rank: int) -> None:
    """megatron's own GPTModel with its alltoall MoE dispatcher at ep=2 (the patched streams, dtoh sync
    and all-to-all split sizes): both data-parallel ranks see the same batch, so the loss must agree."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from slime.backends.megatron.parallel import init_parallel

    init_parallel(1, 2, 1, seed=5)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            add_bias_linear=False, num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
                            moe_token_dispatcher_type="alltoall", hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4), vocab_size=64, max_sequence_length=16)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    loss = model(ids, torch.arange(9).expand(2, 9), None, labels=ids).mean()
    loss.backward()
    losses = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(losses, loss.detach().reshape(1))
    assert torch.isfinite(loss) and torch.allclose(losses[0], losses[1])
    grads = [p.grad for p in model.parameters() if getattr(p, "allreduce", True) is False]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def distributed_optimizer_matches_plain(ckpt: str, ref) -> None:
    """dp=2 (tp=ep=pp=1): one Adam step with megatron's distributed optimizer (grads reduce-scattered,
    params all-gathered over gloo) leaves the same weights as the plain optimizer."""
    from safetensors.torch import load_file
    from slime.backends.megatron import build_optimizer, load_hf_model

    ids, pos, weight = ref["ids"], ref["pos"], ref["weight"]
    after = []
    for distributed in (False, True):
        model = load_hf_model(ckpt)
        ddp, opt = build_optimizer(model, lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        (ddp(ids, pos) * weight).sum().backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    plain, dist_opt = after
    original = load_file(os.path.join(ckpt, "model.safetensors"))
    assert not torch.equal(plain["embedding.weight"], original["model.embed_tokens.weight"])  # the step moved weights
    for n in plain:
        torch.testing.assert_close(dist_opt[n], plain[n], rtol=1e-5, atol=1e-6, msg=f"distributed optimizer: {n}")
