"""Context parallel over gloo (ranks spawned here): on the tiny GLM-5 (MLA + DSA dropping keys + MoE, float32),
with sequences longer than 2 x index_topk, the real trainer actor at CP2 and CP2 x TP2 gives the single-rank
run's per-token log-probs (abs 1e-5), the keys the DSA indexer selects for every real token of every layer
(exactly), the loss of one RL train step (rel 1e-5) and the updated weights (every exported HF tensor:
max |diff| / max |w| <= 1e-5)."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from glm5_helpers import max_rel, rl_batch, spawn_ranks, write_checkpoint


def long_rollout_batch() -> dict:
    return rl_batch(4, 1, lengths=(19, 30), responses=(4, 9))  # > 2 x index_topk (8), odd lengths need CP padding


def _spawn(world: int, names: list[str], ckpt: str, batch: str, out: str) -> None:
    from context_parallel_worker import run

    spawn_ranks(run, world, ckpt, batch, out, names)


def _selections(out: str, name: str) -> dict:
    merged: dict = {}
    for path in glob.glob(os.path.join(out, f"{name}.indexer.*.pt")):
        for layer, sample, pos, keys in torch.load(path):
            merged[(layer, sample, pos)] = keys
    return merged


@pytest.mark.timeout(600)
def test_context_parallel_equals_single_rank(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3)
    batch_path = str(tmp_path / "batch.pt")
    batch = long_rollout_batch()
    torch.save(batch, batch_path)
    out = str(tmp_path)
    _spawn(1, ["single"], ckpt, batch_path, out)
    _spawn(2, ["cp2"], ckpt, batch_path, out)
    _spawn(4, ["cp2_tp2"], ckpt, batch_path, out)

    from safetensors.torch import load_file

    ref = torch.load(os.path.join(out, "single.pt"))
    initial = load_file(os.path.join(ckpt, "model.safetensors"))
    assert max(max_rel(ref["weights"][n], initial[n]) for n in initial) > 1e-3  # the step moves the weights
    ref_sel = _selections(out, "single")
    real = sum(len(t) for t in batch["tokens"])
    assert len(ref_sel) == real * len({k[0] for k in ref_sel})  # every real token of every DSA layer
    dropped = sum(1 for (_, s, p), keys in ref_sel.items() if p + 1 > len(keys))
    assert dropped > real // 2, "DSA should drop keys for most tokens (sequences > index_topk)"
    for name in ("cp2", "cp2_tp2"):
        got = torch.load(os.path.join(out, f"{name}.pt"))
        assert got["log_probs"].keys() == ref["log_probs"].keys(), name
        for i, lp in ref["log_probs"].items():
            assert torch.allclose(got["log_probs"][i], lp, rtol=0, atol=1e-5), (name, i, (got["log_probs"][i] - lp).abs().max())
        sel = _selections(out, name)
        assert sel.keys() == ref_sel.keys(), name
        differ = [k for k in ref_sel if sel[k] != ref_sel[k]]
        assert not differ, f"{name}: indexer selections differ at (layer, sample, position) {differ[:3]}"
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), name
        assert got["entropy"] == pytest.approx(ref["entropy"], rel=1e-5), name
        assert got["weights"].keys() == ref["weights"].keys(), name
        worst = max(ref["weights"], key=lambda n: max_rel(got["weights"][n], ref["weights"][n]))
        err = max_rel(got["weights"][worst], ref["weights"][worst])
        assert err <= 1e-5, f"{name}: updated {worst} differs from the single-rank step by {err:.3g} (rel)"


@pytest.mark.timeout(600)
def test_mtp_training_under_context_parallel_equals_single_rank(tmp_path):
    """--enable-mtp-training at CP2: each rank's chunks take the MTP inputs one token ahead from the whole pack
    (a chunk's last row needs the next chunk's first token, held by the other rank), and the MTP loss is scored
    on the response rows each rank holds: loss, MTP loss and updated weights (MTP layer included) equal the
    single-rank step."""
    from glm5_helpers import add_mtp_layer
    from safetensors.torch import load_file

    ckpt = add_mtp_layer(write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3), seed=5)
    batch_path = str(tmp_path / "batch.pt")
    torch.save(long_rollout_batch(), batch_path)
    out = str(tmp_path)
    _spawn(1, ["single_mtp"], ckpt, batch_path, out)
    _spawn(2, ["cp2_mtp"], ckpt, batch_path, out)
    ref, got = (torch.load(os.path.join(out, f"{n}.pt")) for n in ("single_mtp", "cp2_mtp"))
    assert ref["mtp_loss"] > 1.0  # cross entropy of a random-init head over 512 tokens
    assert got["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-5)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    eh = "model.layers.3.eh_proj.weight"
    assert max_rel(ref["weights"][eh], load_file(os.path.join(ckpt, "model.safetensors"))[eh]) > 1e-3  # MTP trained
    worst = max(ref["weights"], key=lambda n: max_rel(got["weights"][n], ref["weights"][n]))
    err = max_rel(got["weights"][worst], ref["weights"][worst])
    assert err <= 1e-5, f"cp2_mtp: updated {worst} differs from the single-rank step by {err:.3g} (rel)"


@pytest.mark.timeout(600)
def test_forked_rollouts_under_context_parallel_reduce_as_upstream(tmp_path):
    """Two rollouts of 2 and 3 samples (an agent's forked session; interleaved, some tokens unmasked), one step:
    the single-rank run packs them into micro-batches of <= 64 tokens (splitting the 3-sample rollout), CP2 into
    others; both give upstream's loss, one token mean per rollout over the step's 2 rollouts, in float64 (the
    step's forward gives the old log-probs: ratio 1, the loss per token -A), and the same updated weights."""
    ckpt = write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3)
    batch = rl_batch(5, 2, lengths=(25, 31), responses=(4, 9))
    batch["rollout_ids"] = [0, 1, 1, 0, 1]
    batch_path, out = str(tmp_path / "batch.pt"), str(tmp_path)
    torch.save(batch, batch_path)
    _spawn(1, ["single_forked"], ckpt, batch_path, out)
    _spawn(2, ["cp2_forked"], ckpt, batch_path, out)
    want = 0.0
    for members in ([0, 3], [1, 2, 4]):
        masks = [torch.tensor(batch["loss_masks"][i], dtype=torch.float64) for i in members]
        adv = sum(float((batch["advantages"][i].double() * m).sum()) for i, m in zip(members, masks))
        want -= adv / sum(float(m.sum()) for m in masks) / 2
    per_sample = -sum(float((batch["advantages"][i].double() * torch.tensor(m, dtype=torch.float64)).sum()) / sum(m)
                      for i, m in enumerate(batch["loss_masks"])) / 5
    assert abs(per_sample - want) > 1e-3  # the per-sample mean would fail
    ref, got = (torch.load(os.path.join(out, f"{n}.pt")) for n in ("single_forked", "cp2_forked"))
    assert ref["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert got["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    worst = max(ref["weights"], key=lambda n: max_rel(got["weights"][n], ref["weights"][n]))
    err = max_rel(got["weights"][worst], ref["weights"][worst])
    assert err <= 1e-5, f"cp2_forked: updated {worst} differs from the single-rank step by {err:.3g} (rel)"


def test_one_writer_per_pipeline_stage_under_context_parallel(monkeypatch):
    """HF export and the per-stage weight sync write from one rank per stage: the CP ranks of DP rank 0 hold the
    same weights, and only CP rank 0 of them writes (two writers raced on the same shard file)."""
    from megatron.core import parallel_state as ps

    from slime.backends.megatron.hf_export import writer_of_stage

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: 0)
    for dp_rank, cp_rank, writes in ((0, 0, True), (0, 1, False), (1, 0, False)):
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda with_context_parallel=False, d=dp_rank, c=cp_rank:
                            d * 2 + c if with_context_parallel else d)
        assert writer_of_stage() is writes, (dp_rank, cp_rank)
