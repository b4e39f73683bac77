"""Process group + megatron model-parallel set-up on the current accelerator."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from slime.accelerator import get_accelerator
from slime.utils.net import free_port


def revert_megatron_patches(keep: str | None = None) -> None:
    """Revert the megatron-core patch set of every accelerator (but `keep`) applied in this process."""
    from slime.accelerator import accelerator_names, patches

    for name in accelerator_names():
        if name != keep and patches.is_applied(name, "megatron"):
            patches.revert_patch_set(name, "megatron")


def apply_megatron_patches() -> list[str]:
    """Apply the current accelerator's megatron-core patch set (once per process). A set applied for a
    different accelerator earlier in this process (tests switching accelerators) is reverted first."""
    acc = get_accelerator()
    revert_megatron_patches(keep=acc.name)
    return acc.apply_patches("megatron")


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    ep: int = 1
    pp: int = 1
    etp: int = 1  # expert tensor parallel (the GLM model supports 1)
    cp: int = 1  # context parallel

    def check(self, world: int) -> None:
        for name, v in (("tp", self.tp), ("ep", self.ep), ("pp", self.pp), ("etp", self.etp), ("cp", self.cp)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if world % (self.tp * self.pp * self.cp):
            raise ValueError(f"world size {world} does not fit tp={self.tp} x cp={self.cp} x pp={self.pp}; change the "
                             "parallel sizes or the number of ranks")
        if world % (self.tp * self.pp) or (world // self.pp) % self.ep:
            raise ValueError(
                f"world size {world} does not fit tp={self.tp} x pp={self.pp} (and ep={self.ep} must divide "
                f"world/pp={world // max(self.pp, 1)}); change the parallel sizes or the number of ranks"
            )
        if (world // self.pp) % (self.ep * self.etp):
            raise ValueError(f"world size {world} does not fit ep={self.ep} x etp={self.etp} x pp={self.pp}; change "
                             "the expert parallel sizes or the number of ranks")


def ensure_process_group() -> None:
    """Join the process group from torchrun-style env vars, or create a single-process one."""
    if dist.is_initialized():
        return
    backend = get_accelerator().process_group_backend()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def init_parallel(tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234, etp: int = 1,
                  cp: int | None = 1) -> ParallelSizes:
    """Patches, process group, megatron model parallel (expert tensor parallel `etp`, 1 for the GLM
    model; context parallel `cp`; None = the initialized groups' size, else 1) and RNG seeds.
    Re-initializes megatron's groups when they exist with other sizes."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if cp is None:
        cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    sizes = ParallelSizes(int(tp), int(ep), int(pp), int(etp), int(cp))
    apply_megatron_patches()
    ensure_process_group()
    sizes.check(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        current = ParallelSizes(ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                                ps.get_pipeline_model_parallel_world_size(),
                                ps.get_expert_tensor_parallel_world_size(), ps.get_context_parallel_world_size())
        if current != sizes:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=sizes.tp, pipeline_model_parallel_size=sizes.pp,
                                     expert_model_parallel_size=sizes.ep, expert_tensor_parallel_size=sizes.etp,
                                     context_parallel_size=sizes.cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return sizes
