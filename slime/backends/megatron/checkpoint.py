"""Trainer checkpoints in Megatron's distributed format (`--ckpt-format torch_dist`, megatron.core.dist_checkpointing).

One iteration directory per save, ROOT/iter_XXXXXXX/ (the rollout id), and ROOT/latest_checkpointed_iteration.txt,
as Megatron lays them out. Inside, megatron's torch_dist files: every tensor is stored once as its global
(unsharded) tensor, written in pieces by the ranks that hold them, so a checkpoint loads at any TP / EP / DP
(and PP) layout:
- `model`: the GLM model's sharded_state_dict (TP-split linears, EP-split experts, layers by global index);
- `optimizer`: the Megatron optimizer's sharded state in model space (the distributed optimizer's shards
  included: `fully_sharded_model_space`), Adam moments following their parameters' sharding;
- `rng_state`: each rank's RNG states (restored only at the layout that wrote them, as Megatron does);
- common values (written by rank 0): `iteration`, `checkpoint_version`, and `slime`: the rollout id, the
  run's extra state (data-source position) and the layout that wrote it.
All-or-nothing: written into ROOT/.tmp_iter_XXXXXXX, renamed into place, then the tracker is replaced
atomically, so a crash mid-save leaves the previous checkpoint loadable and the tracker pointing at it.
The former per-rank format (iter_*/rank_XXXXX.pt) is still read, at the layout that wrote it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from slime.backends.megatron import checkpoint_layout as L
from slime.backends.megatron.checkpoint_layout import (  # noqa: F401 (re-exported)
    HF, LEGACY, NONE, TORCH_DIST, TRACKER, CheckpointFormatError, find_checkpoint, iter_dir, latest_iteration)
from slime.backends.megatron.rng_state import rng_state, seed_everything, set_rng_state  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0  # megatron's current checkpoint_version
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space", "chained_optim_avoid_prefix": True}


@dataclass(frozen=True)
class LoadOptions:
    """What a resume restores (Megatron's --no-load-optim, --no-load-rng, --finetune)."""

    optimizer: bool = True
    rng: bool = True
    finetune: bool = False  # weights only; the run starts at rollout 0 with fresh data-source state

    @classmethod
    def from_args(cls, args) -> "LoadOptions":
        return cls(optimizer=not getattr(args, "no_load_optim", False), rng=not getattr(args, "no_load_rng", False),
                   finetune=bool(getattr(args, "finetune", False)))


@dataclass
class Resumed:
    start_rollout_id: int  # first rollout to run
    extra_state: dict[str, Any] = field(default_factory=dict)  # empty for --finetune
    restored: tuple[str, ...] = ()  # "model", "optimizer", "rng"


def _unwrap(model):
    return getattr(model, "module", model)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_object(state: Any, world: int, rank: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _sharded_state(model, optimizer, *, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
    state: dict[str, Any] = {"model": _unwrap(model).sharded_state_dict()}
    if with_optimizer and optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return state


def _publish(tmp: str, final: str) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same rollout id saved again) is moved aside first
    and removed only after the new one is in place."""
    old = f"{final}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save(root: str, rollout_id: int, model, optimizer, rank: int, layout: dict[str, int],
         extra_state: dict[str, Any]) -> str:
    """Collective over the trainer ranks. Returns the final iteration directory."""
    from megatron.core import dist_checkpointing

    final = iter_dir(root, rollout_id)
    tmp = os.path.join(root, f".tmp_iter_{rollout_id:07d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        os.makedirs(tmp)
    _barrier()
    state = _sharded_state(model, optimizer, is_loading=False, with_optimizer=True)
    state["rng_state"] = _rng_object(rng_state(), int(layout["world_size"]), _rank())
    state.update(iteration=rollout_id, checkpoint_version=CHECKPOINT_VERSION,
                 slime={"rollout_id": rollout_id, "extra": extra_state, "layout": dict(layout)})
    dist_checkpointing.save(state, tmp)
    _barrier()
    if rank == 0:
        _publish(tmp, final)
        _atomic_write(os.path.join(root, TRACKER), str(rollout_id))
    _barrier()
    return final


def load(root: str, model, optimizer, rank: int, layout: dict[str, int],
         options: LoadOptions = LoadOptions()) -> Resumed:
    """Restore the checkpoint `root` names (a --save root or one iter_* directory) into this rank's model
    and optimizer, at this run's layout. Collective over the trainer ranks."""
    found = L.find_checkpoint(root)
    if found.kind not in (L.TORCH_DIST, L.LEGACY):
        raise L.CheckpointFormatError(f"--load {root} holds no trainer checkpoint ({TRACKER} + iter_XXXXXXX/)")
    if found.kind == L.LEGACY:
        from slime.backends.megatron.checkpoint_legacy import load_per_rank

        rollout_id, extra = load_per_rank(found.path, model, optimizer, rank, layout, options)
        return _resumed(rollout_id, extra, options, ("model", "optimizer", "rng"))
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(found.path)
    meta = common.get("slime") or {}
    saved_layout = meta.get("layout")
    want_optimizer = options.optimizer and not options.finetune
    want_rng = options.rng and not options.finetune
    if want_rng and saved_layout != dict(layout):
        logger.info("checkpoint %s was written at layout %s, this run uses %s: RNG state not restored (as Megatron "
                    "does after a TP/PP change); model and optimizer are resharded", found.path, saved_layout, layout)
        want_rng = False
    state = _sharded_state(model, optimizer, is_loading=True, with_optimizer=want_optimizer)
    if want_rng:
        state["rng_state"] = _rng_object(None, int(layout["world_size"]), _rank())
    loaded = dist_checkpointing.load(state, found.path)
    _unwrap(model).load_state_dict(loaded["model"])
    restored = ["model"]
    if want_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        restored.append("optimizer")
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # main (fp32) params follow the loaded weights
    if want_rng:
        set_rng_state(loaded["rng_state"])
        restored.append("rng")
    rollout_id = int(meta.get("rollout_id", common.get("iteration", found.iteration)))
    return _resumed(rollout_id, meta.get("extra") or {}, options, tuple(restored))


def _resumed(rollout_id: int, extra: dict[str, Any], options: LoadOptions, restored: tuple[str, ...]) -> Resumed:
    if options.finetune:
        return Resumed(0, {}, ("model",))
    return Resumed(rollout_id + 1, extra, restored)


def load_model_weights(path: str, model, flag: str = "--ref-load") -> int:
    """Only the model weights of the torch_dist checkpoint `path` names (e.g. the reference policy), resharded
    to this rank's layout. Collective. Returns the iteration loaded."""
    from megatron.core import dist_checkpointing

    found = L.find_checkpoint(path, flag)
    if found.kind != L.TORCH_DIST:
        raise L.CheckpointFormatError(f"{flag} {path} is not a torch_dist checkpoint ({TRACKER} + iter_XXXXXXX/ "
                                      "with metadata.json)")
    state = _sharded_state(model, None, is_loading=True, with_optimizer=False)
    _unwrap(model).load_state_dict(dist_checkpointing.load(state, found.path)["model"])
    return int(found.iteration or 0)
