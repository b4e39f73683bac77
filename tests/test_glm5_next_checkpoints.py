"""GLM-5.3-Flash (glm5_next) torch_dist checkpoints across layouts, on the tiny checkpoints saved by transformers
(tests/glm5_next_helpers.py). KDA's per-head convolutions, dt_bias and A_log are TP shards, stored split over TP
like megatron's column-parallel weights, so a checkpoint holds every head whatever TP size wrote it.
- the flat text-only checkpoint saved at TP1 (weights moved off the HF values), loaded at TP2, EP2 and PP2 (2 gloo
  ranks): every exported HF tensor equal, bit for bit; saved at TP2 and loaded at TP1: the same;
- tools/convert_hf_to_torch_dist.py at TP2 (2 ranks) then tools/convert_torch_dist_to_hf.py with no extra flag
  (the multimodal checkpoint's vision tower, which torch_dist does not hold, comes back from --origin-hf-dir): the
  flat and the multimodal HF checkpoints back bit for bit (names, dtypes, shapes, bytes);
- weights and Adam moments through DP2 -> PP2 -> TP2 / EP2 (distributed optimizer) -> DP2: bit-identical.
"""

from __future__ import annotations

import json

import pytest
import torch
from glm5_next_helpers import hf_reference, save_checkpoints

LAYOUT = {"world_size": 1, "tp": 1, "ep": 1, "pp": 1}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return save_checkpoints(hf_reference(), tmp_path_factory.mktemp("glm5_next_ckpt"))


def _exported(model) -> dict[str, torch.Tensor]:
    from slime.backends.megatron import export_hf

    return {n: t.detach().clone() for bucket in export_hf(model) for n, t in bucket}


@pytest.mark.timeout(600)
def test_torch_dist_checkpoints_load_at_other_layouts_and_convert_back_bit_exact(ckpts, tmp_path):
    from glm5_helpers import spawn_ranks
    from glm5_next_checkpoints_worker import LAYOUTS, run
    from test_checkpoint_interchange import _digest

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.convert import torch_dist_to_hf
    from slime.backends.megatron.hf_loader import load_hf_model

    text_ckpt = ckpts["glm5_next_text"]
    model = load_hf_model(text_ckpt)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():  # off the HF values: a load that read the HF checkpoint would differ
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    want = _exported(model)
    C.save(str(tmp_path / "tp1"), 0, model, None, 0, LAYOUT, {})
    torch.save(want, tmp_path / "want.pt")
    spawn_ranks(run, 2, text_ckpt, str(tmp_path / "tp1"), str(tmp_path / "want.pt"),
                [(hf, str(tmp_path / f"{model_type}_td")) for model_type, hf in ckpts.items()],
                str(tmp_path / "tp2"), str(tmp_path / "result.json"))
    ranks = [json.load(open(f"{tmp_path / 'result.json'}.{rank}")) for rank in range(2)]
    for name in LAYOUTS:
        assert [r["differing"][name] for r in ranks] == [[], []], name
        assert set(ranks[0]["exported"][name]) | set(ranks[1]["exported"][name]) == set(want), name

    fresh = load_hf_model(text_ckpt)
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(float("nan"))
    C.load_model_weights(str(tmp_path / "tp2"), fresh)
    got = _exported(fresh)
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []

    for model_type, hf in ckpts.items():
        converted = tmp_path / f"{model_type}_td"
        common = torch.load(str(converted / "release" / "common.pt"), weights_only=False)
        assert common["args"].tensor_model_parallel_size == 2
        # no -a: the vision tower is in no torch_dist checkpoint (the trainer never trains it); it comes back from
        # the origin checkpoint all the same, so the converted checkpoint is the model it came from
        out = str(tmp_path / f"{model_type}_hf")
        torch_dist_to_hf(["--input-dir", str(converted), "--output-dir", out, "--origin-hf-dir", hf])
        assert _digest(out) == _digest(hf), model_type


@pytest.mark.timeout(400)
def test_weights_and_adam_moments_round_trip_bit_exact_through_tp2_ep2_pp2(ckpts, tmp_path):
    """tests/checkpoint_reshard_worker.py's chain on the flat checkpoint: one Adam step at DP2, then DP2 -> PP2 ->
    TP2 and EP2 x DP2 (distributed optimizer) -> DP2, each loading the previous checkpoint and saving it again:
    weights and Adam moments (KDA's TP-split ones included) stay bit-identical."""
    from checkpoint_reshard_worker import run_chain
    from rank_spawn import spawn

    from slime.utils.net import free_port

    spawn(run_chain, args=(free_port(), ckpts["glm5_next_text"], str(tmp_path)), nprocs=2, join=True)
