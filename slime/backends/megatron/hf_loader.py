"""load_hf_model: an HF checkpoint into this rank's megatron model shard on the current accelerator.

The model family comes from the registry (slime_plugins/models/registry.py) by config.json's
`model_type`. All checks run before any weight is copied: missing shard files, unsupported model_type,
missing or unused tensor names, shape mismatches each end in one HFCheckpointError listing every
offending name, and no model is returned half-loaded.
"""

from __future__ import annotations

import torch

from slime.backends.megatron.hf_io import HFCheckpoint, HFCheckpointError, name_list

__all__ = ["HFCheckpointError", "load_hf_model"]


def _expected_full_shape(kind: str, local: tuple[int, ...], tp: int) -> tuple[int, ...] | None:
    """Shape every HF tensor of a map must have, from this rank's shard shape."""
    from slime_plugins.models.common import weights as W

    if kind == W.TP_ROWS:
        return (local[0] * tp, *local[1:])
    if kind == W.TP_COLS:
        return (local[0], local[1] * tp, *local[2:])
    if kind == W.TP_GATE_UP:
        return (local[0] * tp // 2, *local[1:])
    if kind == W.TP_GATE_UP_FUSED:
        return (local[0] * tp, *local[1:])
    if kind == W.REPLICATED:
        return local
    if kind == W.EXPERT_W1:  # per expert gate / up [I, H] from [E_local, H, 2I]
        return (local[2] // 2, local[1])
    if kind == W.EXPERT_W2:  # per expert down [H, I] from [E_local, I, H]
        return (local[2], local[1])
    return None


def _check_names(ckpt: HFCheckpoint, family, arch, load_mtp: bool) -> None:
    from slime_plugins.models.common.weights import is_mtp_layer_name, is_mtp_name

    expected = set(family.call("hf_names", arch))
    available = ckpt.names()
    mtp = {n for n in available if is_mtp_name(arch, n)}
    missing = expected - available
    unused = available - expected - mtp
    if load_mtp:  # the MTP layers' tensors are the MTP block's; other kept ones (a vision tower) stay kept
        names, aliases = family.call("mtp_names", arch)
        wanted_mtp = set(names) | set(aliases)
        missing |= wanted_mtp - available
        unused |= {n for n in mtp - wanted_mtp if is_mtp_layer_name(arch, n)}
    problems = []
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if unused:
        problems.append(f"unused tensors (not part of a {arch.model_type} model): {name_list(unused)}")
    if problems:
        raise HFCheckpointError(f"{ckpt.dir}: " + "; ".join(problems))


def _check_mtp_aliases(ckpt: HFCheckpoint, family, arch) -> None:
    _, aliases = family.call("mtp_names", arch)
    differ = [n for n, main in aliases.items() if not torch.equal(ckpt.get(n), ckpt.get(main))]
    if differ:
        raise HFCheckpointError(f"{ckpt.dir}: MTP tensors {name_list(differ)} differ from the main embedding / lm_head; "
                                "slime ties them (load with load_mtp=False to keep them unchanged instead)")


def _stage(model, ckpt: HFCheckpoint, maps, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's shard of every mapped tensor, shape-checked against the model."""
    targets = dict(model.state_dict(keep_vars=True))
    unmapped = set(targets) - {m.param for m in maps} - {n for n in targets if n.endswith("._extra_state")}
    if unmapped:  # a model/mapping mismatch in this code base, not in the checkpoint
        raise RuntimeError(f"model tensors without an HF mapping: {name_list(unmapped)}")
    staged, mismatched = {}, []
    for m in maps:
        target = targets[m.param]
        full = [ckpt.get(n) for n in m.hf]
        want = _expected_full_shape(m.kind, tuple(target.shape), tp)
        if want is not None:
            bad = [f"{n} {tuple(t.shape)} (model expects {want})" for n, t in zip(m.hf, full) if tuple(t.shape) != want]
            if bad:
                mismatched += bad
                continue
        try:
            local = m.to_local(full, tp_rank, tp)
        except RuntimeError as e:  # e.g. experts of different shapes
            mismatched.append(f"{name_list(m.hf, 2)} ({e})")
            continue
        if tuple(local.shape) != tuple(target.shape):
            mismatched.append(f"{name_list(m.hf, 2)} -> {tuple(local.shape)} (model expects {tuple(target.shape)})")
            continue
        staged[m.param] = local
    if mismatched:
        raise HFCheckpointError(f"{ckpt.dir}: shape mismatches: " + "; ".join(mismatched[:12])
                                + (f" ... (+{len(mismatched) - 12} more)" if len(mismatched) > 12 else ""))
    return staged


def load_hf_model(hf_dir: str, tp: int = 1, ep: int = 1, pp: int = 1, *, dtype: torch.dtype | None = None,
                  load_mtp: bool = False, gather_logits: bool = True, seed: int = 1234, **config_overrides):
    """The megatron model of this rank for the checkpoint's model family (any registered model_type),
    weights from `hf_dir`.

    Call inside an initialized process group whose megatron model parallel sizes are (tp, ep, pp), or in
    a single process (a one-rank group on `get_accelerator().process_group_backend()` is created).
    Applies the accelerator's megatron patches. dtype: default the checkpoint's (config.json "dtype"),
    else float32; the GLM router weight, expert bias and indexer gate stay float32 as in transformers.
    load_mtp: also build and load the checkpoint's MTP layer(s) (config num_nextn_predict_layers).
    The model is called as model(input_ids, position_ids, attention_mask=None, packed_seq_params=None)
    and returns logits [B, S, V], gathered over TP when gather_logits (every TP rank gets the full vocab).
    """
    from megatron.core import parallel_state as ps

    from slime.backends.megatron.parallel import init_parallel
    from slime_plugins.models.common.weights import is_mtp_layer_name, is_mtp_name
    from slime_plugins.models.registry import UnsupportedModelError, parse_hf_config

    ckpt = HFCheckpoint(hf_dir)
    try:
        family, arch = parse_hf_config(ckpt.config)
    except UnsupportedModelError as e:
        raise HFCheckpointError(f"{hf_dir}: {e}") from e
    if load_mtp and not family.supports_mtp:
        raise HFCheckpointError(f"{hf_dir}: load_mtp=True but the {family.name} model family has no MTP training "
                                "(its MTP tensors are kept unchanged with load_mtp=False)")
    if load_mtp and not arch.mtp_num_layers:
        raise HFCheckpointError(f"{hf_dir}: load_mtp=True but config.json has no num_nextn_predict_layers")
    _check_names(ckpt, family, arch, load_mtp)
    init_parallel(tp, ep, pp, seed=seed, cp=None)  # context parallel: as initialized (it shards no weights)
    dtype = dtype or ckpt.dtype() or torch.float32
    extra = {"mtp": True} if load_mtp else {}
    model = family.call("build_model", arch, tp, ep, pp, dtype=dtype, gather_logits=gather_logits, **extra,
                        **config_overrides)
    staged = _stage(model, ckpt, family.call("weight_maps", model), ps.get_tensor_model_parallel_rank(), tp)
    if load_mtp:
        _check_mtp_aliases(ckpt, family, arch)
    if model.post_process:  # kept tensors not trained here (untrained MTP layers, a vision tower) are written back
        # unchanged by export_hf / save_hf
        model.passthrough_hf = {n: ckpt.get(n) for n in sorted(ckpt.names())
                                if is_mtp_name(arch, n) and not (load_mtp and is_mtp_layer_name(arch, n))}
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in staged.items():
            targets[name].copy_(value.to(device=targets[name].device, dtype=targets[name].dtype))
    model.hf_dtypes = {n: ckpt.tensor_dtype(n) for n in ckpt.names()}  # save_hf writes each tensor back in its dtype
    model.hf_fused = ckpt.fused_parts()  # and fused expert tensors fused again (Qwen3.5-MoE's published layout)
    model.hf_fp8 = ckpt.fp8_weights()  # read dequantized; an FP8 engine gets them re-quantized (utils/fp8_blocks)
    ckpt.close()
    model.hf_dir = hf_dir
    return model
