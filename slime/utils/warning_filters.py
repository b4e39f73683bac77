"""Library warnings that are known to be harmless here, filtered in every slime process (the trainer ranks and
engines that Ray's log forwarding prints with a `(MegatronTrainRayActor pid=...)` prefix, 210-296 columns wide,
where they read like errors). Each entry is narrow: the warning's category, the start of its message and the
module that issues it; anything else still shows. `SLIME_SHOW_ALL_WARNINGS=1` keeps them all.

Installed by `import slime` (slime/__init__.py), before megatron or torch.distributed is imported.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    category: type[Warning]
    message: str  # regular expression matched at the start of the message
    module: str  # regular expression for the module that calls warnings.warn
    why: str


KNOWN_HARMLESS = (
    KnownWarning(UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\.core\.",
                 "megatron-core without TransformerEngine/Apex (CPU, NPU builds) falls back to its local torch "
                 "implementations of the fused optimizer / multi-tensor ops; those are the ones this trainer "
                 "selects there anyway (issued 4 times per rank: fsdp mixed precision, optimizer, clip_grads)"),
    KnownWarning(FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
                 r"torch\.distributed\.",
                 "torch 2.13 deprecates these collectives under new names; megatron-core's distributed optimizer "
                 "still calls the old ones, which work unchanged (remove when megatron-core switches)"),
)

SHOW_ALL_ENV = "SLIME_SHOW_ALL_WARNINGS"


def install() -> None:
    if os.environ.get(SHOW_ALL_ENV, "") not in ("", "0"):
        return
    for w in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
