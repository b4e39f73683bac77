"""--update-weight-mode disk: the weights through a filesystem both sides see (upstream's
`--update-weight-transport disk` with --update-weight-disk-dir).

Every sync writes the exported weights as one complete HF safetensors checkpoint, `DIR/weight_v{version:06d}`
(each pipeline stage's sender writes its own files, bucket by bucket), and once every stage has written,
trainer rank 0 asks every engine to load it (SGLang's `POST /update_weights_from_disk {"model_path",
"weight_version"}`); the directory is removed after the engines loaded it unless
--update-weight-disk-keep-files. A sync in which any stage failed publishes nothing: no engine is asked to load,
and rank 0 removes what the other stages wrote. Nothing is shared in memory: the engines may run on other hosts, as long
as DIR is on a filesystem they mount at the same path.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from slime.backends.megatron.weight_sync.common import SyncRound, check_reply
from slime.utils import weight_checksum


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"weight_v{version:06d}")


class DiskTransport:
    def __init__(self, ctx: Any, root: str | None, keep_files: bool = False) -> None:
        self.ctx, self.root, self.keep_files = ctx, root, keep_files

    def prepare(self, rnd: SyncRound) -> None:
        """Rank 0, before any stage writes: an empty directory for this version (a failed earlier sync of the
        same version may have left files)."""
        path = version_dir(self._root(), rnd.version)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)

    def begin(self, rnd: SyncRound) -> "DiskStage":
        return DiskStage(self, rnd)

    def conclude(self, rnd: SyncRound, error: BaseException | None) -> None:
        """Rank 0, once every stage's outcome is gathered (every sender is done writing): publish when all wrote
        their files; else remove what the others wrote, so that a partial checkpoint never sits under DIR looking
        like a complete one (also with --update-weight-disk-keep-files: no engine loaded it)."""
        if error is None:
            self.publish(rnd)
        elif self.root:
            shutil.rmtree(version_dir(self.root, rnd.version), ignore_errors=True)

    def publish(self, rnd: SyncRound) -> None:
        """Rank 0, after every stage wrote its files: every engine loads the checkpoint; then it is removed."""
        path = version_dir(self._root(), rnd.version)
        try:
            for engine in self.ctx.engines:
                reply = self.ctx.post(engine, "/update_weights_from_disk",
                                      {"model_path": path, "weight_version": str(rnd.version)},
                                      timeout=self.ctx.timeout_s)
                check_reply(reply, "/update_weights_from_disk")
        finally:
            if not self.keep_files:
                shutil.rmtree(path, ignore_errors=True)

    def _root(self) -> str:
        if not self.root:
            raise ValueError("--update-weight-mode disk needs --update-weight-disk-dir DIR (a directory the "
                             "trainer and every engine see at the same path)")
        return self.root

    def close(self) -> None:
        return None


class DiskStage:
    """One sync's buckets of this stage's sender, each written as a safetensors file of the version's checkpoint."""

    def __init__(self, transport: DiskTransport, rnd: SyncRound) -> None:
        self.transport, self.round = transport, rnd
        self.path = version_dir(transport._root(), rnd.version)
        self.stage = transport.ctx.role.stage
        self.files = 0
        self.expected: dict[str, list[int]] = {}

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        if self.round.failed is not None:
            return 0
        from safetensors.torch import save_file

        try:
            if self.transport.ctx.check:
                self.expected.update(weight_checksum.named_checksums(bucket))
            # own host copies: safetensors refuses views that share storage (the export hands out views)
            tensors = {name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format) for name, t in bucket}
            self.files += 1
            save_file(tensors, os.path.join(self.path, f"model-stage{self.stage:02d}-{self.files:05d}.safetensors"),
                      metadata={"format": "pt"})
        except BaseException as e:  # noqa: BLE001 - keep iterating: the other ranks are in the export's collectives
            self.round.fail(e)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self) -> dict[str, list[int]]:
        if self.round.failed is not None:
            raise self.round.failed
        return self.expected

    def abandon(self) -> None:
        return None
