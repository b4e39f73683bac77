"""A trainer rank joins the trainer's process group: its device, rank 0's rendezvous store, Megatron's
model-parallel groups (`join_trainer_group`, called from the Ray actor's init)."""

from __future__ import annotations

from slime.accelerator import get_accelerator


def host_store(host: str, world_size: int):
    """Rank 0's rendezvous store (it listens on every interface, on a port the OS picks; `host` is the address
    the ranks reach, rank 0's own client included), created with the actor. A port only
    chosen then and bound at init() could meanwhile be taken by any of the run's processes starting up (the
    other ranks, the engines, Ray's workers): rank 0 then failed to bind it while the other ranks waited for
    its store until their rendezvous timeout (30 min)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout  # init_process_group's rendezvous timeout

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=default_pg_timeout)


def client_store(master: tuple[str, int], world_size: int):
    """Rank > 0: a client of rank 0's store. Every rank passes an explicit store to init_process_group: a tcp://
    init_method keeps its keys where a store passed in by rank 0 does not, and the ranks would never meet."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore(*master, world_size, is_master=False, timeout=default_pg_timeout)


def join_trainer_group(args, rank: int, world_size: int, store, master: tuple[str, int] | None) -> None:
    """This process's device, the trainer's process group (on `store`, rank 0's own, or a client of the one at
    `master`) and the model-parallel groups with the accelerator's Megatron patches."""
    import torch.distributed as dist

    acc = get_accelerator()
    acc.init_worker_process()
    acc.set_device(0)  # worker_env made exactly this rank's device visible
    if args.deterministic_mode:  # before the process group and the model: env of the collectives, algorithms
        acc.set_deterministic()
    if not dist.is_initialized():
        store = store if store is not None else client_store(master, world_size)
        dist.init_process_group(backend=acc.process_group_backend(), store=store, world_size=world_size, rank=rank)
    from slime.backends.megatron import init_parallel

    init_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                  args.pipeline_model_parallel_size, seed=args.seed, etp=args.expert_tensor_parallel_size,
                  cp=args.context_parallel_size)  # patches + model-parallel groups
