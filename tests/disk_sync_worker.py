"""Worker of tests/test_weight_sync_disk_parallel.py: one trainer rank (MegatronTrainRayActor, in-process, no Ray,
ranks over gloo) loads a checkpoint and syncs it with --update-weight-mode disk into the engine the test serves.
World 1 records what the single-rank sender exports (the reference); at PP2 (and TP2 x PP2) each stage's sender
writes its own files, and a failing write on one stage's sender must leave the engine as it was. Rank 0 saves what
the test compares."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _actor(ckpt: str, world: int, rank: int, layout: dict, disk_dir: str):
    from pp_train_worker import train_args

    from slime.backends.megatron.actor import MegatronTrainRayActor

    args = train_args(ckpt, world, layout)
    args.update_weight_mode, args.colocate = "disk", False
    args.update_weight_disk_dir, args.update_weight_disk_keep_files = disk_dir, True
    args.update_weight_buffer_size = 64 << 10  # several files per stage
    actor = MegatronTrainRayActor(world, rank)
    actor.init(args)
    return actor, args


def _failing_writes(stage: int, after: int):
    """safetensors' save_file on this process fails from its `after`+1-th call on (a full disk), on `stage`'s sender."""
    import safetensors.torch as st

    real, calls = st.save_file, [0]

    def save_file(*a, **k):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(28, f"No space left on device (stage {stage}, file {calls[0]})")
        return real(*a, **k)

    st.save_file = save_file
    return lambda: setattr(st, "save_file", real)


def _sync_outcome(ws, version: int) -> dict:
    try:
        return {"metrics": ws.sync(version)}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}


def run(rank: int, world: int, port: int, ckpt: str, layout: dict, out_dir: str, engine: dict) -> None:
    try:
        _run(rank, world, port, ckpt, layout, out_dir, engine)
    except BaseException:
        import traceback

        traceback.print_exc()  # the parent is blocked serving the engine; the error must show here too
        raise


def _run(rank: int, world: int, port: int, ckpt: str, layout: dict, out_dir: str, engine: dict) -> None:
    import warnings

    from slime.backends.megatron.weight_sync import create_weight_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("ignore")
    disk_dir = os.path.join(out_dir, "sync")
    actor, args = _actor(ckpt, world, rank, layout, disk_dir)
    ws = create_weight_sync(args, actor.model, [engine], rank)
    posts: list[str] = []
    post = ws.post
    ws.post = lambda e, path, *a, **k: (posts.append(path), post(e, path, *a, **k))[1]
    result: dict = {"stage": ws.role.stage, "sender": ws.role.sender}
    if world == 1:  # the reference: every bucket the single-rank sender hands its transport
        result["exported"] = [[(n, t.detach().cpu().clone()) for n, t in bucket] for bucket in ws.export()]
    else:
        for version, failing_stage in ((1, 1), (2, 0)):  # a full disk on one stage's sender, after its first file
            restore = _failing_writes(failing_stage, 1) if ws.role.sender and ws.role.stage == failing_stage else None
            result[f"failed_{failing_stage}"] = _sync_outcome(ws, version)
            result[f"failed_{failing_stage}"]["posts"] = list(posts)
            result[f"failed_{failing_stage}"]["left"] = os.path.exists(os.path.join(disk_dir, f"weight_v{version:06d}"))
            posts.clear()
            if restore is not None:
                restore()
            if rank == 0:  # what the engine holds after the failed sync (the test compares with what it loaded)
                result[f"failed_{failing_stage}"]["engine"] = post(ws.engines[0], "/get_weights_checksum", {})
            dist.barrier()
    result["ok"] = _sync_outcome(ws, 3)
    result["ok"]["posts"] = list(posts)
    ws.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v for k, v in result.items() if k != "exported"})
    if rank == 0:
        result["ranks"] = gathered
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()
