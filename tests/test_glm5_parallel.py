"""Tensor and expert parallelism of the GLM-5 model, 2 processes over gloo: for (tp, ep) in (1,1), (2,1)
[sequence parallel], (1,2): logits equal tp=ep=1 (1e-5) and transformers (as in test_glm5_model),
grads after megatron DDP's reduction equal transformers' grads, export_hf reproduces the checkpoint
exactly (MTP layer included), MTP logits do not change with the layout, every TP shard carries megatron's
tensor-parallel attributes, and the optimizer's grad norm equals the tp=ep=1 value on every rank (1e-5).
At ep=2 a rank whose experts receive no tokens (expert bias steering all tokens away) matches ep=1.
Then pp=2 through megatron's pipeline schedule: logits, per-stage grads, export, save_hf of both stages;
megatron's own GPTModel with its alltoall MoE dispatcher at ep=2 (patched dispatcher path); and at dp=2 the
distributed optimizer's step equals the plain optimizer's. One spawn per accelerator runs all three layouts."""

from __future__ import annotations

import socket

import pytest
import torch
from glm5_helpers import add_mtp_layer, hf_grads_by_checkpoint_name, hf_model, random_batch, write_checkpoint
from rank_spawn import spawn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accel_name", ["cpu", "npu-sim"])
def test_tp2_and_ep2_match_single_rank_and_transformers(tmp_path, accel_name):
    if accel_name == "npu-sim":
        pytest.importorskip("npu_sim")
    ckpt = add_mtp_layer(write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=2), seed=2)
    ids, pos = random_batch(2, 12, 512, 7)  # 12 > index_topk: DSA drops tokens; 12 % tp == 0 for SP
    weight = torch.randn(2, 12, 512, generator=torch.Generator().manual_seed(7))
    ref = hf_model(ckpt)
    logits = ref(ids, position_ids=pos).logits
    (logits * weight).sum().backward()
    torch.save({"ids": ids, "pos": pos, "weight": weight, "logits": logits.detach(),
                "grads": hf_grads_by_checkpoint_name(ref)}, tmp_path / "ref.pt")
    from glm5_parallel_worker import run

    spawn(run, args=(_port(), accel_name, ckpt, str(tmp_path / "ref.pt")), nprocs=2, join=True)
