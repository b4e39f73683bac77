"""Rollouts saved to disk and replayed: upstream's --save-debug-rollout-data / --load-debug-rollout-data.

File format (upstream's): `torch.save({"rollout_id": id, "samples": [Sample.to_dict(), ...]})` at
`PATH.format(rollout_id=id)`; an evaluation's samples at `PATH.format(rollout_id="eval_<id>")`. The samples are
the rollout function's, after rewards, before they become training data, so a replay goes through the same
reward post-processing and packing as the original run.

Only plain data is written (dicts, lists, strings, numbers, tensors; numpy arrays become tensors) and files are
read with `torch.load(weights_only=True)`: replaying a file never runs code from it. A file holding other
objects (e.g. one upstream wrote with a numpy array inside) is refused with one line.
"""

from __future__ import annotations

import enum
import logging
import os
import pickle
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class DebugDataError(ValueError):
    """A debug rollout file that cannot be written or read; the message is one line."""


def _plain(value: Any, where: str) -> Any:
    """`value` as what torch's weights-only unpickler reads back: containers, scalars, strings, tensors."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, enum.Enum):
        return _plain(value.value, where)
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise DebugDataError(f"--save-debug-rollout-data: {where} is a {type(value).__name__}; only plain data (dicts, "
                         "lists, numbers, strings, arrays) is saved: keep other objects out of Sample fields/metadata")


def rollout_path(template: str, rollout_id: int | str) -> str:
    try:
        return template.format(rollout_id=rollout_id)
    except (KeyError, IndexError, ValueError) as e:
        raise DebugDataError(f"debug rollout path {template!r}: only the {{rollout_id}} placeholder is filled "
                             f"({type(e).__name__}: {e})") from None


def _write(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def save_rollout(template: str | None, samples: list, rollout_id: int) -> str | None:
    """The rollout's samples (list of Sample) to `template.format(rollout_id=...)`; returns the path."""
    if template is None:
        return None
    path = rollout_path(template, rollout_id)
    data = [_plain(s.to_dict(), f"sample {i}") for i, s in enumerate(samples)]
    _write(path, {"rollout_id": rollout_id, "samples": data})
    logger.info("saved rollout %d (%d samples) to %s", rollout_id, len(data), path)
    return path


def save_eval(template: str | None, data: dict, rollout_id: int) -> str | None:
    """An evaluation's samples ({set name: {"samples": [...]}}, flattened) to the eval_<id> file."""
    if template is None:
        return None
    path = rollout_path(template, f"eval_{rollout_id}")
    samples = [_plain(s.to_dict(), f"eval sample {i}")
               for i, s in enumerate(s for info in data.values() for s in info.get("samples", []))]
    _write(path, {"rollout_id": rollout_id, "samples": samples})
    return path


def load_rollout(template: str, rollout_id: int, subsample: float | None = None) -> list:
    """The samples saved for `rollout_id`, as Sample objects. `subsample` (upstream's
    --load-debug-rollout-data-subsample): keep that fraction, half from the start and half from the end."""
    from slime.utils.types import Sample

    path = rollout_path(template, rollout_id)
    if not os.path.isfile(path):
        raise DebugDataError(f"--load-debug-rollout-data: {path} (rollout {rollout_id}) does not exist; save it with "
                             f"--save-debug-rollout-data {template} or lower --num-rollout")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DebugDataError(f"--load-debug-rollout-data: {path} is not a plain-data rollout file (read with "
                             f"weights_only=True, no code runs): {first}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("samples"), list):
        raise DebugDataError(f"--load-debug-rollout-data: {path} holds no 'samples' list; not a saved rollout")
    samples = [Sample.from_dict(d) for d in obj["samples"]]
    if subsample is not None:
        before, n = len(samples), int(len(samples) * subsample)
        if n < 1:
            raise DebugDataError(f"--load-debug-rollout-data-subsample {subsample} keeps no sample of the {before} "
                                 f"in {path}; raise it")
        samples = samples[:n // 2] + samples[before - (n - n // 2):]
        logger.info("--load-debug-rollout-data-subsample %s: %d -> %d samples", subsample, before, len(samples))
    return samples
