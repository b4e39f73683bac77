"""The hybrid Qwen families under model parallelism, 2 processes over gloo (tests/model_families_parallel_worker.py):
qwen3_next (Gated DeltaNet + gated attention, MoE with gated shared expert, a dense layer) at tp=2 [sequence
parallel: the DeltaNet gathers the TP ranks' tokens, splits its heads], ep=2 and cp=2 [the DeltaNet gathers the CP ranks' chunks and
runs whole sequences]; qwen3_5_text (dense) at tp=2, cp=2 and pp=2 (megatron's pipeline schedule, each stage
building its layers' own token mixers). Each: logits within 1e-5 of transformers',
grads after megatron DDP's reduction within 1e-4 x max |grad| of transformers' (as tests/test_qwen3_next_family.py),
export bit-exact on every rank, equal grad norms, torch_dist checkpoints written at one layout loading at the others."""

from __future__ import annotations

import pytest
import torch
from glm5_helpers import hf_grads_by_checkpoint_name, hf_model, random_batch
from rank_spawn import spawn
from test_qwen3_next_family import write_hybrid_checkpoint

from slime.utils.net import free_port


@pytest.mark.timeout(300)
def test_tp2_ep2_cp2_match_transformers(tmp_path):
    cases = []
    # tp=1 is tests/test_qwen3_next_family.py's; qwen3_next's torch_dist checkpoint written at tp=2 loads at ep=2
    for model_type, layouts in (("qwen3_next", [(2, 1), (1, 2), "cp2"]), ("qwen3_5_text", [(2, 1), "cp2", "pp2"])):
        ckpt = write_hybrid_checkpoint(str(tmp_path / model_type), model_type, seed=5)
        ids, pos = random_batch(2, 12, 512, 8)  # 12 % tp == 0 (sequence parallel), % 2 * cp == 0
        weight = torch.randn(2, 12, 512, generator=torch.Generator().manual_seed(8))
        ref = hf_model(ckpt)
        logits = ref(ids, position_ids=pos).logits
        (logits * weight).sum().backward()
        torch.save({"ids": ids, "pos": pos, "weight": weight, "logits": logits.detach(), "grad_tol": 1e-4,
                    "grads": hf_grads_by_checkpoint_name(ref)}, tmp_path / f"{model_type}.pt")
        cases.append((model_type, ckpt, str(tmp_path / f"{model_type}.pt"), layouts))
    from model_families_parallel_worker import run

    spawn(run, args=(free_port(), cases, str(tmp_path / "torch_dist")), nprocs=2, join=True)
