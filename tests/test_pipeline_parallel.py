"""Pipeline parallel training, ranks spawned over gloo: one RL step (old/reference log-probs, GRPO loss with
KL and entropy, Adam step, log-probs after it) on the tiny GLM-5 (float32, DSA dropping keys, MoE) at PP2,
PP2 with uneven stages, TP2 x PP2 and PP2 x EP2 gives the single-rank step's loss and grad norm (rel 1e-5),
per-token log-probs (abs 1e-5) and updated weights (rel 1e-5). At PP2 both stages' weights are synced into a
real embedded engine (ipc and distributed), verified by checksums covering both stages. MTP training
(--enable-mtp-training, the MTP layer on the last stage with its own embedding copy) at PP2 x DP2 and TP2 x PP2
gives the single-rank MTP step's loss, MTP loss, grad norm, log-probs and weights, both embedding copies equal,
also after a torch_dist save and load.
Also: the stage split and the pipeline flags' validation."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from rank_spawn import spawn

from slime.utils.net import free_port


def test_stage_layer_counts_follow_megatron_and_reject_bad_splits():
    from slime.backends.megatron.pipeline import stage_layer_counts

    assert stage_layer_counts(3, 2) == [1, 2]  # default: the last stage takes the remainder
    assert stage_layer_counts(3, 2, first=2) == [2, 1]
    assert stage_layer_counts(78, 4, last=18) == [20, 20, 20, 18]
    assert stage_layer_counts(78, 8, first=14, last=16) == [14] + [8] * 6 + [16]
    for layers, pp, first, last, needle in [(3, 4, None, None, "exceeds the model's 3 decoder layers"),
                                            (3, 2, 3, None, "leave 0 layers for 1 other stage"),
                                            (10, 4, 3, None, "leave 7 layers for 3 other stage"),
                                            (3, 1, 2, None, "need --pipeline-model-parallel-size > 1")]:
        with pytest.raises(ValueError, match=needle):
            stage_layer_counts(layers, pp, first, last)


def _glm5_dir(tmp_path, layers):
    (tmp_path / "config.json").write_text(f'{{"model_type": "glm_moe_dsa", "num_hidden_layers": {layers}}}')
    return str(tmp_path)


@pytest.mark.parametrize("layout", [
    # upstream slime's GLM-5 744B (TP4 PP4, last stage 18 layers, EP32) and GLM-5.2 (PP8, first/last 14/16)
    ["--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4",
     "--sequence-parallel", "--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "18",
     "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1"],
    ["--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4",
     "--pipeline-model-parallel-size", "8", "--decoder-first-pipeline-num-layers", "14",
     "--decoder-last-pipeline-num-layers", "16", "--expert-model-parallel-size", "32",
     "--expert-tensor-parallel-size", "1"],
])
def test_upstream_glm5_pipeline_layouts_validate(tmp_path, layout):
    from slime.config.arguments import parse_args

    args = parse_args(["--hf-checkpoint", _glm5_dir(tmp_path, 78), "--num-rollout", "1", "--global-batch-size", "64",
                       *layout])
    assert args.data_parallel_size == 8 and args.pipeline_model_parallel_size in (4, 8)


@pytest.mark.parametrize("extra, needle", [
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage: interleaved virtual pipeline stages are not supported"),
    (["--decoder-first-pipeline-num-layers", "3"], "leave 0 layers for 1 other stage(s)"),
    (["--pipeline-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--decoder-last-pipeline-num-layers",
      "1"], "need --pipeline-model-parallel-size > 1"),
])
def test_bad_pipeline_layouts_fail_with_one_line(tmp_path, extra, needle, capsys):
    from slime.config.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--hf-checkpoint", _glm5_dir(tmp_path, 3), "--num-rollout", "1", "--global-batch-size", "8",
                    "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and needle in err and "\n" not in err and "--" in err


@pytest.mark.parametrize("first, refused", [(3, True), (2, False), (4, False)])
def test_a_stage_never_starts_with_a_shared_indexer_layer(tmp_path, first, refused, capsys):
    """The tiny glm5_next's layer 3 is a 'shared' DSA layer (it reuses layer 2's top-k): a stage that starts with
    it is refused before Ray, in one line naming the layer and the flag; the other splits pass."""
    from slime.config.arguments import parse_args
    from slime_plugins.models.glm5_next.tiny import tiny_config

    text = tiny_config("glm5_next_text").to_dict()
    assert text["indexer_types"][3] == "shared" and text["layer_types"][2:4] == ["indexed_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps(text))
    argv = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "1", "--global-batch-size", "8",
            "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
            "--decoder-first-pipeline-num-layers", str(first)]
    if not refused:
        assert parse_args(argv).pipeline_model_parallel_size == 2
        return
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert "stage 2 starts with layer 3" in err and "top-k of layer 2" in err and "--decoder-first" in err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5"))


def _spawn(world, ckpt, layouts, out_dir, engine=None):
    from pp_train_worker import run

    ctx = spawn(run, args=(world, free_port(), ckpt, layouts, str(out_dir), engine), nprocs=world, join=False)
    # Poll the exit codes: with the engine's server threads in this process, ctx.join() was seen to miss the
    # workers' exit. A failing worker prints its traceback itself.
    while any(p.exitcode is None for p in ctx.processes):
        time.sleep(0.5)
    codes = [p.exitcode for p in ctx.processes]
    assert codes == [0] * world, f"worker exit codes {codes} (tracebacks above)"
    return {layout["name"]: torch.load(os.path.join(out_dir, f"{layout['name']}.pt")) for layout in layouts}


@pytest.fixture(scope="module")
def single_rank(ckpt, tmp_path_factory):
    return _spawn(1, ckpt, [{"name": "single"}], tmp_path_factory.mktemp("single"))["single"]


def _assert_same_step(got, ref, name):
    m, r = got["metrics"][0], ref["metrics"][0]
    train = {k: v for k, v in m.items() if k.startswith("train/")}
    assert all({k: v for k, v in x.items() if k.startswith("train/")} == train for x in got["metrics"]), \
        f"{name}: ranks report different training metrics"
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/kl", "train/grad_norm", "train/tokens"):
        assert m[key] == pytest.approx(r[key], rel=1e-5, abs=1e-9), f"{name}: {key} {m[key]} != {r[key]}"
    assert r["train/grad_norm"] > 1.0  # clipping is active: the global norm over all stages matters
    for when in ("before", "after"):
        for key in ("old_log_probs", "ref_log_probs"):
            assert got[when][key].keys() == ref[when][key].keys(), f"{name}: samples of {when} {key}"
            for i, lp in ref[when][key].items():
                torch.testing.assert_close(got[when][key][i], lp, rtol=0, atol=1e-5, msg=f"{name}: {when} {key} {i}")
    # second step via train_rollout (advantages with a KL reward on every stage's share)
    assert all(x == got["step2"][0] for x in got["step2"]), f"{name}: ranks report different step-2 metrics"
    for key in ("train/loss", "train/grad_norm", "train/advantage_abs_mean", "train_rollout_logprob_abs_diff"):
        assert got["step2"][0][key] == pytest.approx(ref["step2"][0][key], rel=1e-5), f"{name}: step 2 {key}"
    assert got["weights"].keys() == ref["weights"].keys(), f"{name}: the stages' exports miss tensors"
    for n, w in ref["weights"].items():
        scale = float(w.abs().max())
        torch.testing.assert_close(got["weights"][n], w, rtol=1e-5, atol=1e-5 * scale, msg=f"{name}: weight {n}")


@pytest.mark.timeout(600)
def test_pp2_and_uneven_stages_match_single_rank_and_sync_every_stage(ckpt, single_rank, tmp_path):
    from safetensors.torch import load_file

    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer

    original = load_file(os.path.join(ckpt, "model.safetensors"))
    assert any(not torch.equal(single_rank["weights"][n], original[n]) for n in original)  # the step moved weights
    engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
    server = EngineHTTPServer(engine, "tok", 0)
    server.start_in_thread()
    try:
        layouts = [{"name": "pp2", "pp": 2}, {"name": "pp2_first2", "pp": 2, "first": 2}]
        results = _spawn(2, ckpt, layouts, tmp_path, engine={"url": server.url, "token": "tok"})
        engine_weights = {n: engine.name_map.resolve(n).detach().cpu().clone() for n in original}
    finally:
        server.stop()
        engine.shutdown()
    for name, got in results.items():
        _assert_same_step(got, single_rank, name)
    sync = results["pp2"]["sync"]
    model_bytes = sum(t.numel() * t.element_size() for t in original.values())
    for mode in ("ipc", "distributed"):  # each tensor sent once, by its stage; rank 0 verified all of them
        assert sync[mode]["weight_sync/checked_tensors"] == len(original), mode
        assert sync[mode]["weight_sync/bytes"] == model_bytes, mode
    assert "differs from the trainer in 1 tensors" in sync["corrupted"]
    for n, w in results["pp2"]["weights"].items():  # the engine holds the trained weights of both stages
        assert torch.equal(engine_weights[n], w), n


@pytest.mark.timeout(600)
def test_tp2_x_pp2_and_pp2_x_ep2_match_single_rank(ckpt, single_rank, tmp_path):
    layouts = [{"name": "tp2_pp2", "tp": 2, "pp": 2}, {"name": "pp2_ep2", "pp": 2, "ep": 2}]
    for name, got in _spawn(4, ckpt, layouts, tmp_path).items():
        _assert_same_step(got, single_rank, name)


@pytest.mark.timeout(600)
def test_mtp_training_at_pp2_matches_single_rank(ckpt, tmp_path_factory):
    import shutil

    from glm5_helpers import add_mtp_layer
    from safetensors.torch import load_file

    mtp_ckpt = str(tmp_path_factory.mktemp("mtp") / "glm5")
    add_mtp_layer(shutil.copytree(ckpt, mtp_ckpt), seed=5)
    original = load_file(os.path.join(mtp_ckpt, "model.safetensors"))
    ref = _spawn(1, ckpt, [{"name": "single_mtp", "mtp": True, "ckpt": mtp_ckpt}], tmp_path_factory.mktemp("s"))
    # PP2 x DP2: the embedding copies' grads summed over the stages after the DP reduce-scatter (matching
    # shards); TP2 x PP2: the copy split over TP like the embedding
    layouts = [{"name": "pp2_dp2_mtp", "pp": 2, "mtp": True, "ckpt": mtp_ckpt, "roundtrip": True},
               {"name": "tp2_pp2_mtp", "tp": 2, "pp": 2, "mtp": True, "ckpt": mtp_ckpt}]
    results = _spawn(4, ckpt, layouts, tmp_path_factory.mktemp("p"))
    ref = ref["single_mtp"]
    r = ref["metrics"][0]
    assert r["train/mtp_loss"] > 1.0  # cross entropy of a random-init head over 512 tokens (~ln 512 = 6.2)
    assert results["pp2_dp2_mtp"]["roundtrip"] == []  # torch_dist save/load at PP2 restores every tensor
    mtp = "model.layers.3."
    for name, got in results.items():
        _assert_same_step(got, ref, name)  # pp2_dp2_mtp: step 2 runs after the load (optimizer state from it)
        assert got["metrics"][0]["train/mtp_loss"] == pytest.approx(r["train/mtp_loss"], rel=1e-5), name
        # the MTP layer trained, on the last stage; the exported embedding copies (one per stage) stayed equal
        assert not torch.equal(got["weights"][mtp + "eh_proj.weight"], original[mtp + "eh_proj.weight"]), name
        assert got["weights"].keys() == original.keys(), name
        torch.testing.assert_close(got["weights"][mtp + "embed_tokens.weight"],
                                   got["weights"]["model.embed_tokens.weight"], rtol=0, atol=0, msg=name)
