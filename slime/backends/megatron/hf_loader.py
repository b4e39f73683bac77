"""load_hf_model: an HF checkpoint into this rank's megatron model shard on the current accelerator.

All checks run before any weight is copied: missing shard files, unsupported model_type, missing or
unused tensor names, shape mismatches each end in one HFCheckpointError listing every offending name,
and no model is returned half-loaded.
"""

from __future__ import annotations

import torch

from slime.backends.megatron.hf_io import HFCheckpoint, HFCheckpointError, name_list

__all__ = ["HFCheckpointError", "load_hf_model"]


def _expected_full_shape(kind: str, local: tuple[int, ...], tp: int) -> tuple[int, ...] | None:
    """Shape every HF tensor of a map must have, from this rank's shard shape."""
    from slime_plugins.models.glm5 import weights as W

    if kind == W.TP_ROWS:
        return (local[0] * tp, *local[1:])
    if kind == W.TP_COLS:
        return (local[0], local[1] * tp, *local[2:])
    if kind == W.TP_GATE_UP:
        return (local[0] * tp // 2, *local[1:])
    if kind == W.REPLICATED:
        return local
    if kind == W.EXPERT_W1:  # per expert gate / up [I, H] from [E_local, H, 2I]
        return (local[2] // 2, local[1])
    if kind == W.EXPERT_W2:  # per expert down [H, I] from [E_local, I, H]
        return (local[2], local[1])
    return None


def _check_names(ckpt: HFCheckpoint, glm, load_mtp: bool) -> None:
    from slime_plugins.models.glm5 import weights as W

    expected = set(W.all_hf_names(glm))
    available = ckpt.names()
    mtp = {n for n in available if W.is_mtp_name(glm, n)}
    missing = expected - available
    unused = available - expected - mtp
    if load_mtp:
        from slime_plugins.models.glm5.mtp import mtp_alias_names, mtp_hf_names

        wanted_mtp = set(mtp_hf_names(glm)) | set(mtp_alias_names(glm))
        missing |= wanted_mtp - available
        unused |= mtp - wanted_mtp
    problems = []
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if unused:
        problems.append(f"unused tensors (not part of a {glm.model_type} model): {name_list(unused)}")
    if problems:
        raise HFCheckpointError(f"{ckpt.dir}: " + "; ".join(problems))


def _is_mtp(glm, name: str) -> bool:
    from slime_plugins.models.glm5.weights import is_mtp_name

    return is_mtp_name(glm, name)


def _check_mtp_aliases(ckpt: HFCheckpoint, glm) -> None:
    from slime_plugins.models.glm5.mtp import mtp_alias_names

    differ = [n for n, main in mtp_alias_names(glm).items() if not torch.equal(ckpt.get(n), ckpt.get(main))]
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
    """The GLM-5-family megatron model of this rank, weights from `hf_dir`.

    Call inside an initialized process group whose megatron model parallel sizes are (tp, ep, pp), or in
    a single process (a one-rank group on `get_accelerator().process_group_backend()` is created).
    Applies the accelerator's megatron patches. dtype: default the checkpoint's (config.json "dtype"),
    else float32; the router weight, expert bias and indexer gate stay float32 as in transformers.
    load_mtp: also build and load the checkpoint's MTP layer(s) (config num_nextn_predict_layers).
    The model is called as model(input_ids, position_ids, attention_mask=None, packed_seq_params=None)
    and returns logits [B, S, V], gathered over TP when gather_logits (every TP rank gets the full vocab).
    """
    from megatron.core import parallel_state as ps

    from slime.backends.megatron.parallel import init_parallel
    from slime_plugins.models.glm5.config import GlmConfig, UnsupportedModelError
    from slime_plugins.models.glm5.model import build_model
    from slime_plugins.models.glm5.weights import maps_for_model

    ckpt = HFCheckpoint(hf_dir)
    try:
        glm = GlmConfig.from_hf(ckpt.config)
    except UnsupportedModelError as e:
        raise HFCheckpointError(f"{hf_dir}: {e}") from e
    except KeyError as e:
        raise HFCheckpointError(f"{hf_dir}: config.json lacks {e.args[0]!r}") from e
    if load_mtp and not glm.mtp_num_layers:
        raise HFCheckpointError(f"{hf_dir}: load_mtp=True but config.json has no num_nextn_predict_layers")
    _check_names(ckpt, glm, load_mtp)
    init_parallel(tp, ep, pp, seed=seed)
    dtype = dtype or ckpt.dtype() or torch.float32
    model = build_model(glm, tp, ep, pp, dtype=dtype, gather_logits=gather_logits, mtp=load_mtp, **config_overrides)
    staged = _stage(model, ckpt, maps_for_model(model), ps.get_tensor_model_parallel_rank(), tp)
    if load_mtp:
        _check_mtp_aliases(ckpt, glm)
    elif model.post_process:  # MTP tensors not trained here are written back unchanged by export_hf / save_hf
        model.passthrough_hf = {n: ckpt.get(n) for n in sorted(ckpt.names()) if _is_mtp(glm, n)}
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in staged.items():
            targets[name].copy_(value.to(device=targets[name].device, dtype=targets[name].dtype))
    ckpt.close()
    model.hf_dir = hf_dir
    return model
