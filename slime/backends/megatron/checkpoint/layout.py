"""What a checkpoint directory holds, without importing torch or megatron (argument validation uses it).

Megatron's layout: ROOT/latest_checkpointed_iteration.txt names the newest complete ROOT/iter_XXXXXXX/
(slime's iteration number is the rollout id). A torch_dist iteration directory holds megatron's
metadata.json (written last by dist_checkpointing.save) with common.pt and *.distcp shards; slime's
former per-rank format holds meta.json + rank_XXXXX.pt. An HF directory holds config.json + *.safetensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # Megatron's tracker word for ROOT/release/ (what upstream's convert_hf_to_torch_dist writes)
ITER_DIR = re.compile(r"iter_(\d{7})")

TORCH_DIST, LEGACY, HF, NONE = "torch_dist", "legacy", "hf", "none"


class CheckpointFormatError(ValueError):
    """A --load / --ref-load directory that cannot be read; the message is one line naming what was expected."""


@dataclass(frozen=True)
class FoundCheckpoint:
    kind: str  # TORCH_DIST | LEGACY | HF | NONE (missing or empty directory: nothing to load)
    path: str  # the iteration directory (TORCH_DIST, LEGACY), the HF directory, or the path as given
    iteration: int | None = None


def iter_dir(root: str, iteration: int) -> str:
    """ROOT/iter_XXXXXXX, or ROOT/release for iteration -1 (Megatron's release checkpoint)."""
    return os.path.join(root, RELEASE if iteration < 0 else f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return -1
    if not text.isdigit():
        raise CheckpointFormatError(f"{path} should hold an iteration (rollout id), got {text!r}; delete it or fix it")
    return int(text)


def iteration_kind(path: str) -> str | None:
    """TORCH_DIST or LEGACY for a complete iteration directory, else None."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return TORCH_DIST
    if os.path.isfile(os.path.join(path, "meta.json")) and os.path.isfile(os.path.join(path, "rank_00000.pt")):
        return LEGACY
    return None


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


def find_checkpoint(path: str, flag: str = "--load") -> FoundCheckpoint:
    """Classify `path` (a --save root, one iter_XXXXXXX directory, or an HF directory); raises
    CheckpointFormatError with one line when it holds something else."""
    torch_dist = f"a torch_dist checkpoint ({TRACKER} + iter_XXXXXXX/ as --save writes)"
    hf = "an HF checkpoint (config.json + *.safetensors)"
    expected = f"{torch_dist} or {hf}"
    if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return FoundCheckpoint(NONE, path)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{flag} {path} is not a directory; pass {expected}")
    iteration = latest_iteration(path)
    if iteration is not None:
        d = iter_dir(path, iteration)
        kind = iteration_kind(d) if os.path.isdir(d) else None
        if kind is None:
            raise CheckpointFormatError(f"{flag} {path}: {TRACKER} names iteration {iteration} but {d} is missing or "
                                        "incomplete (no metadata.json); point the tracker at a complete iter_* directory")
        return FoundCheckpoint(kind, d, iteration)
    base = os.path.basename(os.path.normpath(path))
    match = ITER_DIR.fullmatch(base)
    if match or (base == RELEASE and iteration_kind(path) == TORCH_DIST):
        kind = iteration_kind(path)
        if kind is None:
            raise CheckpointFormatError(f"{flag} {path} is an incomplete iteration directory (no metadata.json); "
                                        f"pass {expected}")
        return FoundCheckpoint(kind, path, int(match.group(1)) if match else -1)
    if is_hf_dir(path):
        return FoundCheckpoint(HF, path)
    raise CheckpointFormatError(f"{flag} {path} holds neither {torch_dist} nor {hf}; pass one of those, or a new/empty "
                                "directory to start from --hf-checkpoint")
