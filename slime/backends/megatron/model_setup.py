"""What the trainer actor needs from the Megatron model, in one place: load from HF, wrap in
Megatron DDP and build the Megatron optimizer, packed forward to full-vocab logits, finish a step
(grad sync + clip + update), host copies of weights (reference policy), HF export/save.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from slime.backends.megatron import data as D


def load_model(args, hf_dir: str) -> torch.nn.Module:
    """The Megatron model (any registered family) for this rank's TP/EP shard, weights from `hf_dir`; returns
    full-vocab logits on every TP rank."""
    from slime.backends.megatron import load_hf_model

    # dropout while training; sequence parallel: slime's models need it at TP > 1 and turn it on there
    overrides = {"hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout}
    if args.sequence_parallel:
        overrides["sequence_parallel"] = True
    for flag, key in (("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
                      ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    overrides.update(recompute_overrides(args))
    if args.moe_router_dtype is not None:  # the MoE router's logits precision (slime_plugins common MoE layer)
        overrides["moe_router_dtype"] = args.moe_router_dtype
    if args.deterministic_mode:  # megatron's embedding then gathers rows (F.embedding's backward is not deterministic)
        overrides["deterministic_mode"] = True
    return load_hf_model(hf_dir, args.tensor_model_parallel_size, args.expert_model_parallel_size,
                         args.pipeline_model_parallel_size, dtype=torch.bfloat16 if args.bf16 else None,
                         load_mtp=bool(args.enable_mtp_training),
                         gather_logits=True, seed=args.seed, **overrides)


def load_reference(args, path: str | None = None, flag: str = "--ref-load") -> torch.nn.Module:
    """The reference policy from --ref-load (or another policy-shaped model, e.g. --opd-teacher-load's teacher:
    `path`, `flag`): an HF directory, or a torch_dist checkpoint (its model weights, resharded to this layout,
    into the model built from --hf-checkpoint)."""
    from slime.backends.megatron.checkpoint import torch_dist as ckpt

    path = args.ref_load if path is None else path
    found = ckpt.find_checkpoint(path, flag)
    if found.kind == ckpt.HF:
        return load_model(args, found.path)
    if found.kind != ckpt.TORCH_DIST:
        raise ckpt.CheckpointFormatError(f"{flag} {path} is neither an HF directory (config.json + "
                                         "*.safetensors) nor a torch_dist checkpoint (latest_checkpointed_iteration.txt "
                                         "+ iter_XXXXXXX/)")
    model = load_model(args, args.hf_checkpoint)
    ckpt.load_model_weights(path, model, flag)
    return model


def recompute_overrides(args) -> dict:
    """Activation recompute flags as Megatron TransformerConfig fields (absent: no recompute)."""
    if args.recompute_granularity is None:
        return {}
    out = {"recompute_granularity": args.recompute_granularity}
    if args.recompute_granularity == "full":
        out.update(recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_modules:
        out["recompute_modules"] = list(args.recompute_modules)
    return out


def wrap_and_build_optimizer(args, model: torch.nn.Module):
    """Megatron DDP (grads reduced in fp32) + Megatron's --optimizer (adam or sgd) with gradient clipping at
    --clip-grad, with the distributed optimizer / overlap / CPU offload flags; the learning rate then follows
    `build_lr_scheduler` (--lr-decay-style, warmup, --min-lr)."""
    from slime.backends.megatron.optimizer import MemoryOptions, build_optimizer

    return build_optimizer(model, args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                           adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                           memory=MemoryOptions.from_args(args), min_lr=args.min_lr, optimizer=args.optimizer,
                           sgd_momentum=args.sgd_momentum)


def build_lr_scheduler(args, optimizer, start_rollout_id: int = 0):
    from slime.backends.megatron.lr_schedule import build_lr_scheduler as _build

    return _build(args, optimizer, start_rollout_id)


def forward(model: torch.nn.Module, mb: D.PackedMicroBatch, device: torch.device, mtp_logits: bool = False,
            indexer_topk: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The model's output for a packed micro-batch (THD: cu_seqlens keep samples apart): [1, T, V]
    full-vocab logits on the last pipeline stage (with mtp_logits: (logits, [logits of each MTP depth])),
    hidden states for the next stage elsewhere. Under context parallel (mb.cp) the input is this CP rank's
    chunks at their global positions, and the output covers them. `indexer_topk`: the rollout's DSA selections
    laid out as this rank's tokens (slime.utils.indexer_replay), handed to the model's DSA layers."""
    from megatron.core.packed_seq_params import PackedSeqParams

    replay = {} if indexer_topk is None else {"indexer_topk": indexer_topk}  # the flag needs a model with DSA layers
    if mb.cp is not None:
        from slime_plugins.models.common.rope import ContextParallelSeqParams

        cp = mb.cp
        cu = cp.cu_seqlens_q.to(device)
        longest = max(b - a for a, b in zip(cp.cu_seqlens_q.tolist(), cp.cu_seqlens_q.tolist()[1:]))
        packed = ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                          max_seqlen_kv=longest, context_parallel=cp)
        local = cp.local_index
        extra = dict(replay)
        if mtp_logits:  # a chunk's tokens k ahead may sit in the next chunk: shift over the whole pack, then take ours
            from slime.backends.megatron.hf_export import unwrap

            extra |= {"mtp_logits": True, "mtp_input_ids": [
                D.tokens_ahead(mb, k)[:, local].to(device) for k in range(1, unwrap(model).arch.mtp_num_layers + 1)]}
        return model(input_ids=mb.tokens[:, local].to(device), position_ids=mb.position_ids[:, local].to(device),
                     attention_mask=None, packed_seq_params=packed, **extra)
    cu = mb.cu_seqlens.to(device)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mb.max_seqlen,
                             max_seqlen_kv=mb.max_seqlen)
    extra = dict(replay, mtp_logits=True) if mtp_logits else dict(replay)
    return model(input_ids=mb.tokens.to(device), position_ids=mb.position_ids.to(device), attention_mask=None,
                 packed_seq_params=packed, **extra)


def finish_step(model, optimizer, lr_scheduler=None, check_for_nan: bool = True) -> float:
    """Reduce grads over data-parallel ranks, clip, update, advance the LR schedule. Returns the (pre-clip)
    global grad norm. A non-finite norm fails the step unless --no-check-for-nan-in-loss-and-grad."""
    import math

    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model])
    ok, grad_norm, _ = optimizer.step()
    finite = ok and (grad_norm is None or math.isfinite(float(grad_norm)))
    if not finite and check_for_nan:
        raise RuntimeError("optimizer step skipped (non-finite gradients); lower --lr or check the data "
                           "(--no-check-for-nan-in-loss-and-grad skips such steps instead)")
    if lr_scheduler is not None:
        lr_scheduler.step(increment=1)
    return float(grad_norm) if grad_norm is not None else 0.0


def sync_params(model) -> None:
    from slime.backends.megatron.optimizer import sync_params as _sync

    _sync(model)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and the buffers a checkpoint holds (e.g. the MoE expert bias, which differs between checkpoints
    of one architecture: a teacher's or a reference's must be swapped in with its weights)."""
    module = _unwrap(model)
    saved = module.state_dict(keep_vars=True).keys()
    return {**dict(module.named_parameters()), **{n: b for n, b in module.named_buffers() if n in saved}}


def host_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in _weights(model).items()}


@contextlib.contextmanager
def swapped_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily load `weights` (host tensors by parameter or buffer name) into `model`, restoring after."""
    params = _weights(model)
    if params.keys() != weights.keys():
        missing = sorted(params.keys() ^ weights.keys())[:3]
        raise ValueError(f"reference weights do not match the model's parameters (e.g. {missing})")
    saved = host_copy(model)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def export_hf(model: torch.nn.Module, bucket_bytes: int):
    """Buckets (lists of (HF name, full tensor)) of the current weights; collective over trainer ranks."""
    from slime.backends.megatron import export_hf as _export

    return _export(model, bucket_bytes)


def save_hf(model: torch.nn.Module, out_dir: str, args) -> None:
    from slime.backends.megatron import save_hf as _save

    _save(model, out_dir)
