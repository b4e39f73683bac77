"""Ranks of tests/test_glm5_next_checkpoints.py: tools/convert_hf_to_torch_dist.py's conversion at TP2, then a
torch_dist checkpoint saved at TP1 loaded at TP2, EP2 and PP2 (every tensor a rank exports compared) and saved
again at TP2. Each rank writes its result to out_json.{rank}."""

from __future__ import annotations

import json
import os

import torch

LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "pp2": (1, 1, 2)}


def run(rank: int, world: int, port: int, hf: str, tp1_dir: str, want_path: str, conversions: list, tp2_dir: str,
        out_json: str) -> None:
    from glm5_helpers import exported_weights, init_rank

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist
    from slime.backends.megatron.hf_loader import load_hf_model

    init_rank(rank, world, port)
    for source, converted in conversions:
        hf_to_torch_dist(["--tensor-model-parallel-size", "2", "--hf-checkpoint", source, "--save", converted])
    want = torch.load(want_path)
    differing, exported = {}, {}
    for name, (tp, ep, pp) in LAYOUTS.items():
        model = load_hf_model(hf, tp, ep, pp).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # every weight must come from the torch_dist checkpoint
        C.load_model_weights(tp1_dir, model)
        got = exported_weights(model)
        # under PP each stage exports its own layers: every name a rank exports must hold the saved tensor
        differing[name] = sorted(n for n in got if n not in want or not torch.equal(got[n], want[n]))
        exported[name] = sorted(got)
        if name == "tp2":
            C.save(tp2_dir, 0, model, None, rank, {"tp": tp, "ep": ep, "pp": pp, "world_size": world}, {})
    with open(f"{out_json}.{rank}", "w") as f:
        json.dump({"differing": differing, "exported": exported}, f)
    os.environ.pop("RANK", None)
