"""--load of a torch_dist iteration checkpoint this trainer did not write (upstream slime's, saved by Megatron-LM's
save_checkpoint): which optimizer state it holds, and whether this trainer can read it.

Megatron's distributed optimizer stores its Adam state in one of two kinds of layout:
- model space (`--dist-ckpt-optim-fully-reshardable`: `fully_reshardable`; older releases'
  `fully_sharded_model_space`): `optimizer.state.{param,exp_avg,exp_avg_sq}.<weight key>`, one global tensor per
  weight under the weight's own key. This trainer saves that form itself; `checkpoint_keys.translate` maps the
  keys onto its parameters, so it is read at any layout. The Adam step sits in common.pt's optimizer
  `param_groups[i]["step"]` (TE's FusedAdam, and Megatron's copy for torch Adam).
- bucket space (Megatron-LM's default `dp_reshardable`, and `dp_zero_gather_scatter`):
  `optimizer.distributed.dp_group_idx_*`, the flat grad-bucket buffers of the run that wrote it (its parameter
  order, bucket sizes and padding). They cannot be mapped onto another model's parameters, so a `--load` that asks
  for the optimizer is refused in one line naming `--no-load-optim`.
Reads only the checkpoint's `.metadata` and, for the step, its common.pt (which the load reads anyway).
"""

from __future__ import annotations

from typing import Any

from slime.backends.megatron.checkpoint.layout import CheckpointFormatError

MODEL_SPACE = "model space"
BUCKET_SPACE = "bucket space"
NO_OPTIMIZER = "none"

_RESUME_WEIGHTS = "pass --no-load-optim to resume from its weights and iteration with fresh Adam state"


def optimizer_keys(state_metadata: dict) -> set[str]:
    """The `optimizer.*` keys (tensors and objects) of a checkpoint's .metadata (checkpoint_check.read_metadata)."""
    return {k for k in state_metadata if k.startswith("optimizer.")}


def optimizer_form(keys) -> str:
    """MODEL_SPACE, BUCKET_SPACE or NO_OPTIMIZER from a checkpoint's optimizer keys."""
    keys = list(keys)
    if any(k.startswith("optimizer.state.") for k in keys):
        return MODEL_SPACE
    if any(k.startswith("optimizer.distributed.") for k in keys):
        return BUCKET_SPACE
    return NO_OPTIMIZER


def check_optimizer_readable(path: str, keys, flag: str = "--load") -> None:
    """Raise CheckpointFormatError (one line) when the optimizer state of the checkpoint at `path` (its
    optimizer keys) cannot be restored here."""
    form = optimizer_form(keys)
    if form == BUCKET_SPACE:
        sharding = "dp_reshardable" if any(".bucket_idx_" in k for k in keys) else "dp_zero_gather_scatter"
        raise CheckpointFormatError(
            f"{flag} {path} holds Megatron's distributed-optimizer state in its {sharding} form (the flat grad buckets "
            f"of the run that wrote it), which cannot be mapped onto this trainer's parameters; {_RESUME_WEIGHTS}, "
            "or save it with --dist-ckpt-optim-fully-reshardable (model-space optimizer state, read here)")
    if form == NO_OPTIMIZER:
        raise CheckpointFormatError(f"{flag} {path} holds no optimizer state (saved with --no-save-optim?); "
                                    f"{_RESUME_WEIGHTS}")


def saved_step(common: dict[str, Any]) -> int | None:
    """The Adam step Megatron stored in common.pt's optimizer param groups (the largest: TE's FusedAdam does not
    count for empty groups), None when there is none."""
    steps: list[float] = []

    def walk(node):
        if isinstance(node, dict):
            groups = node.get("param_groups")
            if isinstance(groups, list):
                steps.extend(float(g["step"]) for g in groups if isinstance(g, dict) and g.get("step") is not None)
            for v in node.values():
                walk(v)

    walk(common.get("optimizer"))
    return int(max(steps)) if steps else None


def foreign_optimizer_step(path: str, keys, common: dict[str, Any], flag: str = "--load") -> int:
    """The Adam step to resume a checkpoint not written here with its optimizer state; one-line
    CheckpointFormatError when that state cannot be read."""
    check_optimizer_readable(path, keys, flag)
    step = saved_step(common)
    if step is None:
        raise CheckpointFormatError(f"{flag} {path} holds Adam moments but no step count (common.pt's optimizer "
                                    f"param_groups); {_RESUME_WEIGHTS}")
    return step
