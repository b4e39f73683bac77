"""Before Ray starts (train.py's preflight and --dry-run): a torch_dist `--load` / `--ref-load` checkpoint's
layout (upstream's names or this project's earlier ones, stacked or per-layer) and its weight keys against
the model `--hf-checkpoint`'s config.json describes. Reads only the checkpoint's `.metadata`."""

from __future__ import annotations

import os

from slime.backends.megatron.checkpoint import keys as K
from slime.backends.megatron.checkpoint.layout import TORCH_DIST, CheckpointFormatError, find_checkpoint
from slime.backends.megatron.hf_io import name_list


def read_metadata(iter_dir: str) -> dict:
    """The key -> storage metadata of a torch_dist iteration directory's `.metadata` (tensors and objects)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(iter_dir).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line
        raise CheckpointFormatError(f"{iter_dir}/.metadata is unreadable ({type(e).__name__}); restore it") from e


def saved_weight_keys(iter_dir: str, metadata: dict | None = None) -> set[str]:
    """Tensor keys of a torch_dist iteration directory's model weights (no optimizer, RNG or extra state)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(iter_dir) if metadata is None else metadata
    return {k for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)
            and not k.startswith(("optimizer.", "rng_state")) and not k.endswith(K.EXTRA_STATE)}


def check_checkpoint(path: str, flag: str, hf_config: dict, optimizer: bool = False) -> str | None:
    """One line describing the torch_dist checkpoint `path` names (None when it is not one); raises
    CheckpointFormatError (one line) when it lacks weights the model loads, or (optimizer: a resume that restores
    Adam state, not from a release checkpoint) when its optimizer state cannot be read here (checkpoint_foreign).
    Keys it holds beyond them (e.g. MTP layers this run does not train) are named in the line: they are not read."""
    from slime.backends.megatron.checkpoint.foreign import check_optimizer_readable, optimizer_keys
    from slime_plugins.models.registry import parse_hf_config

    found = find_checkpoint(path, flag)
    if found.kind != TORCH_DIST:
        return None
    metadata = read_metadata(found.path)
    if optimizer and found.iteration != -1:
        check_optimizer_readable(found.path, optimizer_keys(metadata), flag)
    saved = saved_weight_keys(found.path, metadata)
    _, arch = parse_hf_config(hf_config)
    layout = K.detect_layout(saved)
    stacked = K.has_stacked_layers(saved)
    want = K.expected_keys(arch, layout, stacked)
    form = f"{layout}, {'stacked layers' if stacked else 'per-layer keys'}"
    missing, unexpected = want - saved, saved - want
    if missing:
        raise CheckpointFormatError(
            f"{flag} {found.path} ({form}) lacks {len(missing)} of the {len(want)} weights the {arch.model_type} model "
            f"of --hf-checkpoint loads: {name_list(missing, 6)}; is it a checkpoint of that model?")
    extra = f"; {len(unexpected)} more not read: {name_list(unexpected, 4)}" if unexpected else ""
    return f"{flag} {found.path}: torch_dist checkpoint ({form}), all {len(want)} model weights present{extra}"


def check_run_checkpoints(args, hf_config: dict, *, unreadable_warns: bool = False) -> tuple[list[str], list[str]]:
    """(lines, warnings) for the run's existing --load / --ref-load directories (check_checkpoint on each; --load
    with its optimizer state unless --no-load-optim / --finetune). Raises CheckpointFormatError (one line) for a
    checkpoint that lacks model weights or whose optimizer state cannot be read, and for a directory
    that holds no checkpoint, unless unreadable_warns (the dry run: e.g. a config-only HF directory on a laptop,
    which the real run checks), which makes the latter a warning."""
    lines, warnings = [], []
    for flag, path in (("--load", args.load), ("--ref-load", args.ref_load)):
        if not path or not os.path.exists(path):
            continue
        if unreadable_warns:
            try:
                find_checkpoint(path, flag)
            except CheckpointFormatError as e:
                warnings.append(str(e))
                continue
        resume_optimizer = flag == "--load" and not args.no_load_optim and not args.finetune
        line = check_checkpoint(path, flag, hf_config, optimizer=resume_optimizer)
        if line:
            lines.append(line)
    return lines, warnings
