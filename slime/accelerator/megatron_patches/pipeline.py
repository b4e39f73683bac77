"""Pipeline parallel: megatron's schedules and point-to-point communication."""

from __future__ import annotations

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch
from slime.accelerator.patches import Patch

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
P2P = "megatron.core.pipeline_parallel.p2p_communication"

PATCHES = [
    Patch(
        name="pipeline_schedules_device",
        targets=(f"{SCHEDULES}:forward_backward_no_pipelining",
                 f"{SCHEDULES}:forward_backward_pipelining_without_interleaving",
                 f"{SCHEDULES}:forward_backward_pipelining_with_interleaving"),
        replacement=lambda orig: with_accelerator_torch(orig, device_literal=True),
        why="every training step through get_forward_backward_func() counts tokens on the device",
        replaces='torch.zeros([], device="cuda") token counters in the schedules (re-bound: "cuda" -> the '
                 "accelerator's device type, torch.cuda.* -> the accelerator)",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core's schedules allocate on the model's device",
    ),
    Patch(
        name="pipeline_p2p_device",
        targets=(f"{P2P}:P2PCommunicator._communicate_shapes", f"{P2P}:P2PCommunicator._communicate"),
        replacement=lambda orig: with_accelerator_torch(orig),
        why="pipeline stages exchange activation shapes and tensors every micro-batch",
        replaces="torch.cuda.current_device() receive buffers and torch.cuda.synchronize() in P2PCommunicator",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core's p2p communication takes the device from an accelerator API",
    ),
]
