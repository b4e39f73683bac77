"""Ranks of tests/test_checkpoint_interchange.py's layout test: the converter under 2 ranks (as torchrun runs
it), then the trainer's `--load` (checkpoint.load, as the train actor calls it) at another layout, its logits
against transformers', and a save there."""

from __future__ import annotations

import json
import os

import torch


def run(rank: int, world: int, port: int, cases: list, out_json: str) -> None:
    from glm5_helpers import init_rank

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist
    from slime.backends.megatron.hf_loader import load_hf_model

    init_rank(rank, world, port)
    results = {}
    for hf, ref_hf, converted, saved, (tp, ep, pp), model_args in cases:
        hf_to_torch_dist([*model_args, "--hf-checkpoint", hf, "--save", converted])
        # MODEL_ARGS with --mtp-num-layers: the MTP layers are in the checkpoint; load them (--enable-mtp-training)
        model = load_hf_model(hf, tp, ep, pp, load_mtp="--mtp-num-layers" in model_args).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # every weight must come from the torch_dist checkpoint
        layout = {"tp": tp, "ep": ep, "pp": pp, "world_size": world}
        resumed = C.load(converted, model, None, rank, layout)
        assert (resumed.start_rollout_id, resumed.restored) == (0, ("model",)), resumed  # a release: weights only
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.arch.vocab_size, (2, 8), generator=gen)
        pos = torch.arange(8).expand(2, -1)
        with torch.no_grad():
            logits = model(ids, pos)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(ref_hf, dtype=torch.float32).eval()
            with torch.no_grad():
                want = ref(input_ids=ids, position_ids=pos).logits
            results[hf] = ((logits - want).abs().max() / want.abs().max()).item()
        C.save(saved, 5, model, None, rank, layout, {})
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump(results, f)
    os.environ.pop("RANK", None)
