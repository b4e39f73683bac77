"""export_hf / save_hf: the megatron model's weights as full HF tensors (TP and EP shards gathered).

export_hf is collective over the tensor- and expert-parallel groups: every rank of a model replica must
iterate it in step. Every rank then receives the full tensors of its own pipeline stage (with pp = 1 the
whole model): weight sync picks what it needs on any rank; save_hf writes from one rank per stage. With
all_stages=True (collective over the pipeline group too) every rank, rank 0 included, receives the whole model:
each stage's buckets in stage order, broadcast over the pipeline group.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

MAX_SHARD_BYTES = 4 << 30
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def unwrap(model):
    """The slime model (common/model.py DecoderModel) inside DDP / Float16Module wrappers."""
    while not hasattr(model, "arch") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "arch"):
        raise TypeError(f"{type(model).__name__} is not a slime model (build it with load_hf_model)")
    return model


def gather_shards(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` of `group`, in rank order (just [t] without a group or with one rank)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def export_hf(model, bucket_bytes: int = 1 << 28, dtype: torch.dtype | None = None, all_stages: bool = False
              ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets (lists of (hf_name, full tensor on the accelerator)) of about `bucket_bytes` each,
    in checkpoint order. Tensors that need no gather are views of the parameters (WeightMap.to_hf), valid
    until the next optimizer step. dtype: cast on the way out (default: the parameters' own, so the router weight
    and expert bias stay float32). Collective over TP and EP (see module docstring); all_stages: every pipeline
    stage's tensors on every rank (collective over PP as well)."""
    from megatron.core import parallel_state as ps

    if all_stages and ps.get_pipeline_model_parallel_world_size() > 1:
        yield from _every_stage(export_hf(model, bucket_bytes, dtype), ps.get_pipeline_model_parallel_group(),
                                ps.get_pipeline_model_parallel_rank())
        return

    from slime_plugins.models.common import weights as W

    model = unwrap(model)
    family = model.family
    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    state = model.state_dict(keep_vars=True)
    maps = family.call("weight_maps", model)
    aliases = {}
    if getattr(model, "mtp", None) is not None:
        _, aliases = family.call("mtp_names", model.arch)  # MTP copies of the (tied) main embedding / lm_head
        aliases = _stage_aliases(aliases, {n for m in maps for n in m.hf})
    wanted = set(aliases.values())
    kept: dict[str, torch.Tensor] = {}

    def entries():
        for m in maps:
            if m.param == "embedding.weight" and model.holds_embedding_copy and not W.is_mtp_name(model.arch, m.hf[0]):
                continue  # the last stage's copy (MTP under PP) of the embedding the first stage exports
            local = state[m.param].detach()
            if m.kind in (W.TP_ROWS, W.TP_COLS, W.TP_GATE_UP, W.TP_GATE_UP_FUSED):
                shards = gather_shards(local, tp_group)
            elif m.kind in (W.EXPERT_W1, W.EXPERT_W2):
                shards = gather_shards(local, ep_group)
            else:
                shards = [local]
            for name, t in zip(m.hf_names_after_gather(model.arch.n_routed_experts), m.to_hf(shards)):
                if name in wanted:
                    kept[name] = t
                yield name, t
        for name, main in aliases.items():
            yield name, kept[main]
        yield from model.passthrough_hf.items()

    named = entries() if dtype is None else ((name, t.to(dtype)) for name, t in entries())
    yield from bucketed(named, bucket_bytes)


def _every_stage(own: Iterator[list[tuple[str, torch.Tensor]]], group, stage: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each stage's buckets in stage order, broadcast from that stage's rank of the pipeline `group`: the bucket's
    names, shapes and dtypes first (None ends the stage), then its tensors, bit for bit. A name an earlier stage
    gave already is not repeated."""
    from slime.accelerator import get_accelerator

    device = get_accelerator().device()
    seen: set[str] = set()
    for source_stage, source in enumerate(dist.get_process_group_ranks(group)):
        mine = source_stage == stage
        while True:
            bucket = next(own, None) if mine else None
            header = [None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket]] if mine else [None]
            dist.broadcast_object_list(header, src=source, group=group, device=device)
            if header[0] is None:
                break
            tensors = ([t.contiguous() for _, t in bucket] if mine else
                       [torch.empty(shape, dtype=dt, device=device) for _, shape, dt in header[0]])
            for t in tensors:
                dist.broadcast(t, src=source, group=group)
            out = [(name, t) for (name, _, _), t in zip(header[0], tensors) if name not in seen]
            seen.update(name for name, _ in out)
            if out:
                yield out


def _stage_aliases(aliases: dict[str, str], own: set[str]) -> dict[str, str]:
    """{MTP copy name: name of the tensor this stage exports it from}, for the copies no weight map of this
    stage exports itself. Under PP the last stage has no main embedding: its embedding copy is exported under
    the first MTP layer's name (a weight map of its own), and further MTP layers' copies repeat that one."""
    export_name = {main: main for main in aliases.values() if main in own}
    export_name.update({main: a for a, main in aliases.items() if a in own and main not in export_name})
    return {a: export_name[main] for a, main in aliases.items() if a not in own}


def bucketed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of about `bucket_bytes`; a bucket closes once it reaches the size."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def writer_of_stage() -> bool:
    """One rank per pipeline stage (TP, EP, CP and DP rank 0) writes or sends the stage's exported tensors."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def save_hf(model, out_dir: str, dtype: torch.dtype | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write an HF checkpoint (safetensors shards + index, config.json, tokenizer files of the source
    checkpoint) to `out_dir`, atomically: into `out_dir`.tmp-save, then renamed. Collective over all ranks."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    model = unwrap(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out_dir.rstrip("/") + ".tmp-save"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    stage = ps.get_pipeline_model_parallel_rank()
    writer = writer_of_stage()
    files: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        if shard and writer:
            fn = f"model-pp{stage:03d}-{len(files):05d}.safetensors"
            save_file(shard, os.path.join(tmp, fn), metadata={"format": "pt"})
            files.append((fn, list(shard)))
        shard, shard_bytes = {}, 0

    stored = getattr(model, "hf_dtypes", {}) if dtype is None else {}
    fused = _FusedExperts(getattr(model, "hf_fused", {}))
    for bucket in export_hf(model, dtype=dtype):
        for name, t in bucket:
            # A tensor kept in float32 here (the indexer gate) that the source checkpoint stored in bf16 goes
            # back in bf16, as upstream's converter writes it (its Megatron parameter is bf16).
            if stored.get(name) is not None and t.is_floating_point() and stored[name] != t.dtype:
                t = t.to(stored[name])
            if writer:
                # An owned copy: exported tensors may be views sharing a parameter (safetensors refuses those).
                t = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())
                for out_name, out in fused.add(name, t):
                    shard[out_name] = out
                    shard_bytes += out.numel() * out.element_size()
            if shard_bytes >= max_shard_bytes:
                flush()
    flush()
    all_files = [files]
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_files = [None] * dist.get_world_size()
        dist.all_gather_object(all_files, files)
    if rank == 0:
        _finish(model, tmp, out_dir, [f for per_rank in all_files for f in per_rank], dtype)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


class _FusedExperts:
    """Per-expert tensors of an expert block the source checkpoint stored fused (transformers 5's
    `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], as Qwen3.5-MoE is published) are held until
    the block is complete, then written as the one fused tensor."""

    def __init__(self, parts: dict[str, tuple[str, int, str]]) -> None:
        self.parts = parts
        self.count: dict[str, int] = {}
        for fused, _, _ in parts.values():
            self.count[fused] = self.count.get(fused, 0) + 1
        self.pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name not in self.parts:
            return [(name, t)]
        fused, expert, part = self.parts[name]
        held = self.pending.setdefault(fused, {})
        held[(expert, part)] = t
        if len(held) < self.count[fused]:
            return []
        del self.pending[fused]
        experts = sorted({e for e, _ in held})
        rows = [held[(e, "all")] if (e, "all") in held else torch.cat([held[(e, "gate")], held[(e, "up")]])
                for e in experts]
        return [(fused, torch.stack(rows))]


def _finish(model, tmp: str, out_dir: str, files: list[tuple[str, list[str]]], dtype) -> None:
    if len(files) == 1:
        os.replace(os.path.join(tmp, files[0][0]), os.path.join(tmp, "model.safetensors"))
    else:
        total = sum(os.path.getsize(os.path.join(tmp, fn)) for fn, _ in files)
        weight_map = {name: fn for fn, names in files for name in names}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(model.arch.hf_config)
    dtypes = {p.dtype for p in model.parameters()}
    out_dtype = dtype or (torch.bfloat16 if torch.bfloat16 in dtypes else next(iter(dtypes)))
    config["dtype"] = str(out_dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    # block-FP8 source weights are trained and written dequantized: the copy states no quantization
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    source = getattr(model, "hf_dir", None)
    for fn in COPIED_FILES:
        if source and os.path.isfile(os.path.join(source, fn)):
            shutil.copy(os.path.join(source, fn), os.path.join(tmp, fn))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
