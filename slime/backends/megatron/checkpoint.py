"""Trainer checkpoints: per-rank model + optimizer + RNG, plus the run's extra state (rollout id,
data-source state), written to a temporary directory and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a partial one.

Layout: SAVE/iter_0000007/{rank_00000.pt, ..., extra.pt, meta.json}; SAVE/latest_checkpointed_iteration.txt.
Files are read with `torch.load(weights_only=True)` (no arbitrary unpickling).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import torch

from slime.accelerator import get_accelerator

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} should hold a rollout id, got {text!r}; delete it or fix --load")
    return int(text)


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    get_accelerator().manual_seed(seed)
    try:  # Megatron's tensor-parallel RNG tracker (dropout regions); absent before model-parallel init
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    except Exception:
        pass


def rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": list(random.getstate()[1]), "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "device": get_accelerator().get_rng_state(),
    }
    try:
        from megatron.core import tensor_parallel

        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["device"])
    if "tracker" in state:
        try:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
        except Exception:
            pass


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: str, rollout_id: int, model, optimizer, rank: int, layout: dict[str, int],
         extra_state: dict[str, Any]) -> str:
    """Collective over the trainer ranks. Returns the final directory."""
    final = iter_dir(root, rollout_id)
    tmp = os.path.join(root, f".tmp_iter_{rollout_id:07d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()},
               os.path.join(tmp, f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        torch.save({"rollout_id": rollout_id, "extra": extra_state}, os.path.join(tmp, "extra.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"rollout_id": rollout_id, "layout": layout}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(os.path.join(root, TRACKER), str(rollout_id))
    _barrier()
    return final


def load(root: str, model, optimizer, rank: int, layout: dict[str, int]) -> tuple[int, dict[str, Any]]:
    """Restore the latest checkpoint under `root`; returns (rollout id, extra state)."""
    rollout_id = latest_iteration(root)
    if rollout_id is None:
        raise FileNotFoundError(f"no {TRACKER} in {root}; pass a directory written by --save")
    d = iter_dir(root, rollout_id)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    if meta["layout"] != layout:
        raise ValueError(f"checkpoint {d} was saved with layout {meta['layout']} but this run uses {layout}; "
                         "resume with the same trainer world size and TP/EP/PP sizes")
    state = torch.load(os.path.join(d, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    extra = torch.load(os.path.join(d, "extra.pt"), map_location="cpu", weights_only=True)
    return int(extra["rollout_id"]), extra["extra"]
