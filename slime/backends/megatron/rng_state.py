"""RNG state of one trainer rank (python, numpy, torch, the accelerator, megatron's TP RNG tracker):
seeded at start, saved with each checkpoint, restored on resume."""

from __future__ import annotations

import random
from typing import Any

import torch

from slime.accelerator import get_accelerator


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
