"""Trainer checkpoints in Megatron's distributed format (`--ckpt-format torch_dist`, megatron.core.dist_checkpointing).

One iteration directory per save, ROOT/iter_XXXXXXX/ (the rollout id), and ROOT/latest_checkpointed_iteration.txt,
as Megatron lays them out. Inside, megatron's torch_dist files: every tensor is stored once as its global
(unsharded) tensor, written in pieces by the ranks that hold them, so a checkpoint loads at any TP / EP / DP
(and PP) layout:
- `model`: the GLM model's sharded_state_dict (TP-split linears, EP-split experts, layers by global index);
- `optimizer`: the Megatron optimizer's sharded state in model space (the distributed optimizer's shards
  included: `fully_reshardable`), Adam moments following their parameters' sharding;
- `rng_state`: each rank's RNG states (restored only at the layout that wrote them, as Megatron does);
- common values (written by rank 0): `iteration`, `checkpoint_version`, and `slime`: the rollout id, the
  run's extra state (data-source position), the layout that wrote it and the optimizer's step count
  (the optimizer's non-tensor state is not stored: hyperparameters come from this run's flags).
All-or-nothing: written into ROOT/.tmp_iter_XXXXXXX, renamed into place, then the tracker is replaced
atomically, so a crash mid-save leaves the previous checkpoint loadable and the tracker pointing at it.
The former per-rank format (iter_*/rank_XXXXX.pt) is still read, at the layout that wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from slime.backends.megatron.checkpoint import keys as K
from slime.backends.megatron.checkpoint import layout as L
from slime.backends.megatron.checkpoint.layout import (  # noqa: F401 (re-exported)
    HF, LEGACY, NONE, TORCH_DIST, TRACKER, CheckpointFormatError, find_checkpoint, iter_dir, latest_iteration)
from slime.backends.megatron.ranks import barrier as _barrier, rank as _rank
from slime.backends.megatron.rng_state import rng_state, seed_everything, set_rng_state  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0  # megatron's current checkpoint_version
# fully_reshardable: the distributed optimizer's shards in model space (per parameter, like the plain optimizer),
# loadable at any TP / EP / DP / PP layout (its flattened-range variant is unsupported in megatron-core 0.16);
# mem_efficient: gathered on DP rank 0 in host memory over the gloo DP group, not all-gathered on every rank.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                      "distrib_optim_fully_reshardable_mem_efficient": True}


@dataclass(frozen=True)
class LoadOptions:
    """What a resume restores (Megatron's --no-load-optim, --no-load-rng, --finetune)."""

    optimizer: bool = True
    rng: bool = True
    finetune: bool = False  # weights only; the run starts at rollout 0 with fresh data-source state

    @classmethod
    def from_args(cls, args) -> "LoadOptions":
        return cls(optimizer=not args.no_load_optim, rng=not args.no_load_rng, finetune=bool(args.finetune))


@dataclass
class Resumed:
    start_rollout_id: int  # first rollout to run
    extra_state: dict[str, Any] = field(default_factory=dict)  # empty for --finetune
    restored: tuple[str, ...] = ()  # "model", "optimizer", "rng"


def _unwrap(model):
    return getattr(model, "module", model)


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


def _sharded_state(model, optimizer, *, is_loading: bool, with_optimizer: bool,
                   stacked: bool = False) -> tuple[dict[str, Any], Any]:
    """({"model": ..., "optimizer": its ShardedTensors}, this rank's non-tensor optimizer state), under the
    model's own names (`checkpoint_keys.translate` gives them upstream's); stacked: megatron's stacked
    layer form (one tensor per name with a layer axis) instead of per-layer keys.

    Only the optimizer's tensors go into the checkpoint: its non-tensor part (param groups, the chained
    optimizers' structure) depends on which parameters a rank holds (a pipeline stage without experts has
    no expert optimizer), so a load at another layout keeps its own and takes the step count from `slime`."""
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    state: dict[str, Any] = {"model": _unwrap(model).sharded_state_dict(metadata={"non_homogeneous_layers": not stacked})}
    local = None
    if with_optimizer and optimizer is not None:
        if is_loading:
            _init_optimizer_state(optimizer)
        with _unpadded_param_index(optimizer), _no_forced_collection():
            full = optimizer.sharded_state_dict(state["model"], is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        state["optimizer"], local = extract_sharded_base(full)
    return state, local


@contextlib.contextmanager
def _unpadded_param_index(optimizer):
    """megatron-core 0.16's `fully_reshardable` save slices each parameter's state out of buffers gathered
    without the padding between grad buckets, at the parameter's offset *with* that padding
    (`buffer.param_index_map`; its own TODO names the bug, issue #504). With one bucket per buffer nothing
    moves; with several (a shared embedding's own bucket under PP with MTP, or bucketed --overlap-grad-reduce)
    every parameter after a padded bucket end was saved shifted. For the call, the map is given the offsets
    the gathered buffers use (order kept: the load side walks it for the state's order); restored after.
    Targets megatron-core 0.16 (MEGATRON_VERSIONS, checked like a patch: a fixed release would be shifted the
    other way); remove when megatron's save slices at unpadded offsets itself."""
    import types

    from slime.accelerator.megatron_patches import MEGATRON_VERSIONS
    from slime.accelerator.patches import check_version

    check_version(types.SimpleNamespace(name="checkpoint._unpadded_param_index", versions=MEGATRON_VERSIONS),
                   "megatron")
    swapped = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for buffer in getattr(opt, "buffers", None) or []:
            starts, at = [], 0
            for bucket in buffer.buckets:
                starts.append(at - bucket.offset)  # padded -> unpadded shift of this bucket's parameters
                at += bucket.numel_unpadded
            original = buffer.param_index_map
            buffer.param_index_map = {p: (a + starts[b], e + starts[b], b) for p, (a, e, b) in original.items()}
            swapped.append((buffer, original))
    try:
        yield
    finally:
        for buffer, original in swapped:
            buffer.param_index_map = original


class _CollectorRunning:
    """The `gc` module as megatron's distributed optimizer sees it while the collector runs by itself:
    `collect()` does nothing (reports 0 objects), everything else is the real module's."""

    @staticmethod
    def collect(generation: int = 2) -> int:
        return 0

    def __getattr__(self, name: str):
        import gc

        return getattr(gc, name)


@contextlib.contextmanager
def _no_forced_collection():
    """megatron-core 0.16's DistributedOptimizer.sharded_state_dict ends its `fully_reshardable` branch
    with a full `gc.collect()`, for runs that disable the collector (`--manual-gc`): the gathered buffers
    would never be freed. With the collector enabled that pass is redundant, and it walks every object of
    the trainer process: ~0.15 s per inner optimizer (the dense and the expert one), most of a small
    model's save. For the call, and only while `gc.isenabled()`, the optimizer module's `gc` is
    `_CollectorRunning`; restored after. A process that disabled the collector keeps megatron's pass.
    Targets megatron-core 0.16 (MEGATRON_VERSIONS, checked like a patch); remove when megatron collects
    only with the collector disabled."""
    import gc
    import importlib
    import types

    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    from slime.accelerator.megatron_patches import MEGATRON_VERSIONS
    from slime.accelerator.patches import check_version

    if not gc.isenabled() or getattr(distrib_optimizer, "gc", None) is not gc:
        yield
        return
    check_version(types.SimpleNamespace(name="checkpoint._no_forced_collection", versions=MEGATRON_VERSIONS),
                  "megatron")
    distrib_optimizer.gc = _CollectorRunning()
    try:
        yield
    finally:
        distrib_optimizer.gc = gc


# The same main (fp32) parameters under the names each optimizer gives them: the distributed optimizer's
# `param`, the bf16 optimizer's `fp32_param`, and (float32 training) the model weight itself.
_MAIN_PARAM_PREFIXES = ("optimizer.state.param.", "optimizer.state.fp32_param.", "")


def _alias_main_params(optimizer_request, saved: set[str]) -> None:
    """Switching between the distributed and the plain optimizer: a main-parameter tensor the checkpoint lacks
    (`saved`: the checkpoint's tensor keys) is read under one of its other names (e.g. a plain float32
    optimizer stores none: the weights are)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for sh in nested_values(optimizer_request):
        key = getattr(sh, "key", None)
        if key is None or key in saved or not key.startswith(_MAIN_PARAM_PREFIXES[:2]):
            continue
        name = key.split(".", 3)[3]
        for prefix in _MAIN_PARAM_PREFIXES:
            if prefix + name in saved:
                sh.key = prefix + name
                if not prefix:  # the model reads the same shard: mark this read as a replica for the validation
                    rid = sh.replica_id
                    sh.replica_id = (1, *rid[1:]) if isinstance(rid, tuple) else 1
                break


def _init_optimizer_state(optimizer) -> None:
    """Zero Adam state (step 0) where none exists yet: the load fills it in place, and the distributed
    optimizer's state_dict needs a step (megatron initializes it the same way, with a dummy step)."""
    import torch

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = getattr(sub, "optimizer", None), getattr(sub, "init_state_fn", None)
        if inner is None or init is None or inner.state:
            continue
        init(inner, sub.config)
        for st in inner.state.values():
            st.setdefault("step", torch.tensor(0.0))


def _inner_optimizers(optimizer):
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(sub, "optimizer", None) is not None:
            yield sub.optimizer


def optimizer_step(optimizer) -> int:
    """Adam steps taken (the same for every parameter), agreed over the trainer ranks."""
    import torch
    import torch.distributed as dist

    steps = [float(st["step"]) for inner in _inner_optimizers(optimizer) for st in inner.state.values() if "step" in st]
    steps += [float(g["step"]) for inner in _inner_optimizers(optimizer) for g in inner.param_groups
              if g.get("step") is not None and g["params"]]
    step = torch.tensor([max(steps, default=0.0)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return int(step.item())


def _with_step(state: Any, step: int) -> Any:
    """Put the saved step where Megatron's optimizers read it in a state dict: state['common_step'] (FP32 /
    Float16 optimizers) and param_groups[i]['step'] (the distributed optimizer, TE's FusedAdam)."""
    import torch

    if isinstance(state, dict):
        if isinstance(state.get("param_groups"), list):
            if isinstance(state.get("state"), dict) and state["state"]:
                state["state"]["common_step"] = torch.tensor(float(step))
            for g in state["param_groups"]:
                if isinstance(g, dict) and "step" in g:
                    g["step"] = step
        for v in state.values():
            _with_step(v, step)
    return state


def _set_optimizer_step(optimizer, step: int) -> None:
    import torch

    for inner in _inner_optimizers(optimizer):
        for st in inner.state.values():
            if st:
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
        for g in inner.param_groups:
            if "step" in g:  # optimizers that count per group (TE's FusedAdam)
                g["step"] = step


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
         extra_state: dict[str, Any], vocab_divisible_by: int = 128, async_save: bool = False):
    """Collective over the trainer ranks. Returns the final iteration directory. Tensors under upstream's
    names (checkpoint_keys), the vocabulary padded as Megatron pads it (vocab_divisible_by x TP rows).
    async_save (--async-save): returns a PendingSave once the tensors are staged (host copies); their files are
    written in the background, and the checkpoint is published by PendingSave.finish, collective as well."""
    from megatron.core import dist_checkpointing

    final = iter_dir(root, rollout_id)  # rollout_id -1: Megatron's release checkpoint (ROOT/release)
    tmp = os.path.join(root, f".tmp_{os.path.basename(final)}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        os.makedirs(tmp)
    _barrier()
    from slime.backends.megatron.optimizer import sync_params

    sync_params(model)  # --overlap-param-gather: the saved weights are the updated ones
    arch = _unwrap(model).arch
    state, _ = _sharded_state(model, optimizer, is_loading=False, with_optimizer=True,
                              stacked=K.stacked_layers(arch))
    K.translate(state, arch, loading=False, vocab_divisible_by=vocab_divisible_by)
    if not state.get("optimizer"):  # a rank that writes none of its tensors (the distributed optimizer's state is
        state.pop("optimizer", None)  # gathered on DP rank 0): an empty dict would be common state only here
    state["rng_state"] = _rng_object(rng_state(), int(layout["world_size"]), _rank())
    state.update(iteration=max(rollout_id, 0), checkpoint_version=CHECKPOINT_VERSION,
                 args=K.megatron_args(arch, layout, vocab_divisible_by),
                 slime={"rollout_id": rollout_id, "extra": extra_state, "layout": dict(layout),
                        "optimizer_step": optimizer_step(optimizer) if optimizer is not None else 0})
    if async_save:
        from slime.backends.megatron.checkpoint.async_save import PendingSave

        request = dist_checkpointing.save(state, tmp, async_sharded_save=True)
        return PendingSave(request, publish=lambda: _published(root, rollout_id, tmp, final, rank), final=final)
    dist_checkpointing.save(state, tmp)
    return _published(root, rollout_id, tmp, final, rank)


def _published(root: str, rollout_id: int, tmp: str, final: str, rank: int) -> str:
    """Collective, once every rank's files are written: the temp directory renamed into place, then the tracker."""
    _barrier()
    if rank == 0:
        _publish(tmp, final)
        _atomic_write(os.path.join(root, TRACKER), L.RELEASE if rollout_id < 0 else str(rollout_id))
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
        from slime.backends.megatron.checkpoint.legacy import load_per_rank

        rollout_id, extra = load_per_rank(found.path, model, optimizer, rank, layout, options)
        return _resumed(rollout_id, extra, options, ("model", "optimizer", "rng"))
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(found.path)
    tensors = dist_checkpointing.load_tensors_metadata(found.path)
    meta = common.get("slime") or {}
    if found.iteration == -1:  # a release checkpoint (converted weights): Megatron starts from it at iteration 0
        options = dataclasses.replace(options, finetune=True)
    if optimizer is None:  # nothing to restore it into
        options = dataclasses.replace(options, optimizer=False)
    foreign_step = None
    if not meta:  # written elsewhere (upstream's converter: a release checkpoint; its training runs)
        options = dataclasses.replace(options, rng=False)  # its RNG state is Megatron-LM's, per rank of its layout
        if options.optimizer and not options.finetune:
            from slime.backends.megatron.checkpoint.check import read_metadata
            from slime.backends.megatron.checkpoint.foreign import foreign_optimizer_step, optimizer_keys

            foreign_step = foreign_optimizer_step(found.path, optimizer_keys(read_metadata(found.path)), common)
        if _rank() == 0:
            what = ("model weights only" if foreign_step is None else
                    f"model weights and Adam state (step {foreign_step})")
            logger.info("--load %s: not written by slime's trainer here; %s, RNG state not read, starting at rollout "
                        "%s", found.path, what, 0 if options.finetune else common.get("iteration", found.iteration) + 1)
    saved_layout = meta.get("layout")
    want_optimizer = options.optimizer and not options.finetune
    want_rng = options.rng and not options.finetune
    if want_rng and saved_layout != dict(layout):
        logger.info("checkpoint %s was written at layout %s, this run uses %s: RNG state not restored (as Megatron "
                    "does after a TP/PP change); model and optimizer are resharded", found.path, saved_layout, layout)
        want_rng = False
    state, local, translation = _request(model, optimizer, found.path, with_optimizer=want_optimizer, metadata=tensors)
    if want_optimizer:
        saved = set(tensors)
        _alias_main_params(state["optimizer"], saved)
        _alias_main_params(state.get(K.SLOT, {}), saved)  # the optimizer entries translate moved
    if want_rng:
        state["rng_state"] = _rng_object(None, int(layout["world_size"]), _rank())
    loaded = dist_checkpointing.load(state, found.path)
    if translation is not None:
        translation.restore(loaded)
    _unwrap(model).load_state_dict(loaded["model"])
    restored = ["model"]
    if want_optimizer:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, local)
        _drop_common(loaded["optimizer"], common.get("optimizer"))
        step = int(meta.get("optimizer_step", 0)) if foreign_step is None else foreign_step
        optimizer.load_state_dict(_with_step(merge(local, loaded["optimizer"]), step))
        _set_optimizer_step(optimizer, step)
        restored.append("optimizer")
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # main (fp32) params follow the loaded weights
    if want_rng:
        set_rng_state(loaded["rng_state"])
        restored.append("rng")
    rollout_id = int(meta.get("rollout_id", common.get("iteration", found.iteration)))
    return _resumed(rollout_id, meta.get("extra") or {}, options, tuple(restored))


def _drop_common(loaded: Any, common: Any) -> None:
    """Remove from a loaded optimizer state what came from the checkpoint's common.pt (dist_checkpointing.load
    merges it in): a Megatron-LM save keeps the optimizer's param groups there; this run keeps its own (`local`)."""
    if not isinstance(loaded, dict) or not isinstance(common, dict):
        return
    for key, value in common.items():
        if isinstance(value, dict) and isinstance(loaded.get(key), dict):
            _drop_common(loaded[key], value)
            if not loaded[key]:
                del loaded[key]
        else:
            loaded.pop(key, None)


def _resumed(rollout_id: int, extra: dict[str, Any], options: LoadOptions, restored: tuple[str, ...]) -> Resumed:
    if options.finetune:
        return Resumed(0, {}, ("model",))
    return Resumed(rollout_id + 1, extra, restored)


def load_model_weights(path: str, model, flag: str = "--ref-load", metadata: dict | None = None) -> int:
    """Only the model weights of the torch_dist checkpoint `path` names (e.g. the reference policy), resharded
    to this rank's layout. Collective. Returns the iteration loaded. metadata: the checkpoint's
    load_tensors_metadata when the caller has read it already."""
    from megatron.core import dist_checkpointing

    found = L.find_checkpoint(path, flag)
    if found.kind != L.TORCH_DIST:
        raise L.CheckpointFormatError(f"{flag} {path} is not a torch_dist checkpoint ({TRACKER} + iter_XXXXXXX/ "
                                      "with metadata.json)")
    state, _, translation = _request(model, None, found.path, with_optimizer=False, flag=flag, metadata=metadata)
    loaded = dist_checkpointing.load(state, found.path)
    if translation is not None:
        translation.restore(loaded)
    _unwrap(model).load_state_dict(loaded["model"])
    return int(found.iteration or 0)


def checkpoint_layout(path: str, metadata: dict | None = None) -> tuple[str, bool, dict[str, tuple]]:
    """(layout, stacked layers, global shape of each tensor) of the torch_dist iteration directory `path`
    (from `metadata`, its load_tensors_metadata, when given)."""
    from megatron.core import dist_checkpointing

    if metadata is None:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    shapes = {k: tuple(v.global_shape) for k, v in metadata.items()}
    stacked = K.has_stacked_layers(shapes)
    return K.detect_layout(shapes), stacked, shapes


def _request(model, optimizer, path: str, *, with_optimizer: bool, flag: str = "--load", metadata: dict | None = None):
    """The load request for this model in the layout the checkpoint at `path` uses (one log line names it):
    (state, non-tensor optimizer state, the Translation to undo after the load or None)."""
    layout, stacked, shapes = checkpoint_layout(path, metadata)
    arch = _unwrap(model).arch
    if _rank() == 0:
        logger.info("%s %s: torch_dist checkpoint with %s%s", flag, path, layout,
                    ", stacked layers" if stacked else "")
    state, local = _sharded_state(model, optimizer, is_loading=True, with_optimizer=with_optimizer, stacked=stacked)
    if layout == K.EARLIER:
        return state, local, None
    return state, local, K.translate(state, arch, loading=True, saved_shapes=shapes)
