"""A trainer rank's WeightSync from the run's flags, its model and the rollout manager's engine list."""

from __future__ import annotations

import logging
from typing import Any

from slime.accelerator import get_accelerator
from slime.backends.megatron.weight_sync.common import EngineEndpoint, StageRole, WeightSyncError
from slime.backends.megatron.weight_sync.controller import WeightSync
from slime.backends.megatron.weight_sync.tensor_handles import PayloadExchange

logger = logging.getLogger(__name__)


def resolve_mode(requested: str, colocate: bool, ipc_capable: bool) -> str:
    """--update-weight-mode: auto is ipc when colocated and the device supports IPC, else distributed (logged);
    disk is taken as asked (any device, colocated or not)."""
    if requested == "disk":
        return "disk"
    if requested == "ipc":
        if not ipc_capable:
            raise WeightSyncError("--update-weight-mode ipc: this device cannot share tensors across processes; "
                                  "use --update-weight-mode distributed (or auto)")
        return "ipc"
    if requested == "distributed":
        return "distributed"
    if colocate and ipc_capable:
        return "ipc"
    if colocate:
        logger.warning("device has no IPC tensor sharing: colocated weight sync falls back to the distributed path")
    return "distributed"


def engines_load_mtp(args: Any, engine_kind: str | None = None) -> bool:
    """Whether the engines hold the checkpoint's MTP layers: SGLang loads them only as the draft model of
    speculative decoding (--sglang-speculative-algorithm, e.g. EAGLE in upstream's GLM-5 and MiMo scripts); the
    embedded engine (transformers' model) has none and ignores the speculative options. `engine_kind`: the
    rollout manager's resolved --rollout-engine (needed when the flag is "auto")."""
    if not args.sglang_speculative_algorithm:
        return False
    kind = engine_kind or args.rollout_engine
    if kind not in ("sglang", "embedded"):
        raise WeightSyncError(f"weight sync needs the resolved rollout engine kind, got {kind!r}; "
                              "the rollout manager's engine list names it")
    return kind == "sglang"


def without_mtp_layers(buckets, arch):
    """The exported buckets minus the MTP layers' tensors (model.layers.{N + k}.*); empty buckets dropped.
    Every rank of a stage exports the same names, so all drop alike."""
    from slime_plugins.models.common.weights import is_mtp_name

    for bucket in buckets:
        kept = [(n, t) for n, t in bucket if not is_mtp_name(arch, n)]
        if kept:
            yield kept


def in_checkpoint_format(buckets, fp8: dict[str, tuple[int, int]]):
    """SGLang serves --hf-checkpoint as stored: a weight the checkpoint keeps in block FP8 (GLM-5.3-Flash's
    experts) is an FP8 parameter there, so it is sent re-quantized in that format, e4m3 + weight_scale_inv per
    block, each checkpoint tensor on its own (slime.utils.fp8_blocks); the trainer holds it dequantized."""
    from slime.utils.fp8_blocks import Fp8BlockFormat, quantize_named

    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            block = fp8.get(name)
            out += quantize_named([(name, tensor)], {name}, Fp8BlockFormat(block)) if block else [(name, tensor)]
        yield out


def _engine_kind(endpoints: list[EngineEndpoint]) -> str | None:
    """The kind the rollout manager resolved for its engines (every engine of a run is of one kind)."""
    kinds = {e.kind for e in endpoints}
    return kinds.pop() if len(kinds) == 1 else None


def create_weight_sync(args: Any, model: Any, engines: list[dict[str, Any]], rank: int) -> WeightSync:
    """This rank's WeightSync: `engines` is the rollout manager's list (EngineEndpoint.from_dict)."""
    import torch.distributed as dist

    from slime.backends.megatron import model_setup
    from slime.backends.megatron.hf_export import unwrap
    from slime.backends.megatron.hf_io import fp8_weights_of

    acc = get_accelerator()
    mode = resolve_mode(args.update_weight_mode, args.colocate, acc.capabilities.ipc)
    endpoints = [EngineEndpoint.from_dict(e) for e in engines]
    timeout = float(args.update_weight_timeout)
    world, exchange = 1, None
    if dist.is_available() and dist.is_initialized():
        from slime.utils.distributed import default_store

        world = dist.get_world_size()
        exchange = PayloadExchange(default_store(), rank, timeout) if mode == "ipc" and world > 1 else None

    arch = unwrap(model).arch
    keep_mtp = engines_load_mtp(args, _engine_kind(endpoints))
    # SGLang loaded --hf-checkpoint: its block-FP8 weights go back in that format
    fp8 = fp8_weights_of(args.hf_checkpoint) if _engine_kind(endpoints) == "sglang" else {}

    def export():
        buckets = model_setup.export_hf(model, args.update_weight_buffer_size)
        buckets = buckets if keep_mtp else without_mtp_layers(buckets, arch)
        return in_checkpoint_format(buckets, fp8) if fp8 else buckets

    return WeightSync(mode, export, endpoints, rank, check=bool(args.check_weight_sync),
                      buffer_bytes=args.update_weight_buffer_size, world_size=world, timeout_s=timeout,
                      exchange=exchange, role=stage_role(rank), disk_dir=args.update_weight_disk_dir,
                      disk_keep_files=args.update_weight_disk_keep_files)


def stage_role(rank: int) -> StageRole:
    """This rank's StageRole from megatron's parallel state: one sender per pipeline stage (with pp = 1, rank 0
    alone, with no extra collectives)."""
    from megatron.core import parallel_state as ps

    stages = ps.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return StageRole(sender=rank == 0)
    import torch.distributed as dist

    from slime.backends.megatron.hf_export import writer_of_stage

    def gather(obj):
        out = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    return StageRole(stage=ps.get_pipeline_model_parallel_rank(), stages=stages, sender=writer_of_stage(),
                     barrier=dist.barrier, gather=gather)
