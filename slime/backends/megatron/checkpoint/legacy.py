"""Reader of slime's former per-rank checkpoints (iter_XXXXXXX/{rank_XXXXX.pt, extra.pt, meta.json}).

Each file holds one rank's unsharded view (model, optimizer, RNG), so it loads only at the layout that
wrote it (world size, TP/EP/PP). Files are read with `torch.load(weights_only=True)`. New checkpoints are
torch_dist (slime/backends/megatron/checkpoint/torch_dist.py); resume once and save to convert.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from slime.backends.megatron.rng_state import set_rng_state


def load_per_rank(d: str, model, optimizer, rank: int, layout: dict[str, int], options) -> tuple[int, dict[str, Any]]:
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    if meta["layout"] != dict(layout):
        raise ValueError(f"checkpoint {d} is in the former per-rank format, saved with layout {meta['layout']}, but this "
                         f"run uses {dict(layout)}; resume with the same trainer world size and TP/EP/PP sizes, then save "
                         "again (torch_dist) to change the layout")
    state = torch.load(os.path.join(d, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    if options.optimizer and not options.finetune:
        optimizer.load_state_dict(state["optimizer"])
    if options.rng and not options.finetune:
        set_rng_state(state["rng"])
    extra = torch.load(os.path.join(d, "extra.pt"), map_location="cpu", weights_only=True)
    return int(extra["rollout_id"]), extra["extra"]
