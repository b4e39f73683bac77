"""Upstream slime's GLM-5 744B layout (scripts/run-glm5-744B-A40B.sh: TP4 PP4 with an 18-layer last stage, CP2,
EP32, expert-TP 1 on 32 x 8 devices) on this train.py: the captured command line validates without --dry-run,
each unsupported change to it fails with one line naming the flag and the fix, and trainer ranks are
placed in the order Megatron numbers its TP / CP / EP / DP / PP groups."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = json.loads((ROOT / "tests/data/upstream_train_commands.json").read_text())["scripts"]["run-glm5-744B-A40B.sh"]


def _argv(tmp_path: Path, config_edit: dict | None = None) -> list[str]:
    """The captured command with this machine's paths (HF config only, a one-line prompt file)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((ROOT / SCRIPT["config"]).read_text())
    (hf / "config.json").write_text(json.dumps({**config, **(config_edit or {})}))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    argv = list(SCRIPT["argv"])
    for flag, value in (("--hf-checkpoint", hf), ("--ref-load", hf), ("--load", tmp_path / "ckpt"),
                        ("--save", tmp_path / "ckpt"), ("--prompt-data", tmp_path / "prompts.jsonl")):
        argv[argv.index(flag) + 1] = str(value)
    # one-node engines (the script's 64-device engines span 8 nodes: tests/test_upstream_scripts.py, test_engine_span.py)
    return argv + ["--output-dir", str(tmp_path / "out"), "--rollout-num-gpus-per-engine", "8"]


@pytest.mark.parametrize("extra, cp", [([], 2), (["--enable-mtp-training"], 2),
                                       (["--enable-mtp-training", "--context-parallel-size", "1"], 1)])
def test_upstream_glm5_744b_layout_validates_as_a_real_run(tmp_path, extra, cp):
    from slime.config.arguments import parse_args

    args = parse_args(_argv(tmp_path) + extra)  # MTP training: on the last of the 4 stages, at CP 2 or 1
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size, args.decoder_last_pipeline_num_layers) == (4, 4, 32, 1, 18)
    assert args.context_parallel_size == cp  # the script's own CP 2
    assert args.world_size == 256 and args.data_parallel_size == 16 // cp


def test_upstream_glm5_744b_dry_run_prints_its_stages(tmp_path, capsys):
    from slime.train import main

    argv = _argv(tmp_path) + ["--dry-run"]  # the script's own CP 2
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "world 256 = dp 8 x tp 4 x pp 4 x cp 2" in out
    assert "layers per pipeline stage [20, 20, 20, 18]" in out


@pytest.mark.parametrize("change, config_edit, needle", [
    (["--expert-tensor-parallel-size", "4"], None,
     "--expert-tensor-parallel-size 4: the GLM model keeps each routed expert whole on one rank (expert-TP 1); use 1"),
    (["--num-layers-per-virtual-pipeline-stage", "5"], None,
     "--num-layers-per-virtual-pipeline-stage: interleaved virtual pipeline stages are not supported"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], None,
     "--num-virtual-stages-per-pipeline-rank: interleaved virtual pipeline stages are not supported"),
    (["--decoder-last-pipeline-num-layers", "17"], None,
     "pipeline stages do not split 78 decoder layers: last 17 leave 61 layers for 3 other stage(s)"),
    (["--pipeline-model-parallel-size", "3"], None,
     "the 256 trainer device(s) (--actor-num-nodes 32 x --actor-num-gpus-per-node 8) do not divide into TP 4 x PP 3 x "
     "CP 2 = 24; valid sizes, the other two as given: --tensor-model-parallel-size none; "
     "--pipeline-model-parallel-size 1, 2, 4, 8, 16, 32; --context-parallel-size none"),
    (["--expert-model-parallel-size", "128"], None,
     "--expert-model-parallel-size 128 x --pipeline-model-parallel-size 4 = 512 to divide the 256 trainer devices"),
    (["--rollout-num-gpus", "240", "--rollout-num-gpus-per-engine", "12"], None,
     "--rollout-num-gpus-per-engine 12 with --colocate: an engine's devices must be on one node or fill whole nodes, "
     "and 12 neither divides nor is a multiple of --num-gpus-per-node 8; use a divisor or a multiple of 8"),
    (["--enable-mtp-training", "--context-parallel-size", "1"], {"num_nextn_predict_layers": 0},
     "--enable-mtp-training: {hf}/config.json has no num_nextn_predict_layers (no MTP layers to train); drop the flag"),
    ([], {"tie_word_embeddings": True},
     "tie_word_embeddings=true needs the embedding and the output layer on one stage: "
     "use --pipeline-model-parallel-size 1 for this checkpoint"),
])
def test_unsupported_change_to_the_744b_layout_fails_with_one_line(tmp_path, capsys, change, config_edit, needle):
    from slime.config.arguments import parse_args

    argv = _argv(tmp_path, config_edit)
    if (config_edit or {}).get("tie_word_embeddings"):  # MODEL_ARGS must say so too, else that is the error
        argv.remove("--untie-embeddings-and-output-weights")
    needle = needle.replace("{hf}", str(tmp_path / "hf"))
    with pytest.raises(SystemExit) as e:
        parse_args(argv + change)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    assert needle in err, err


def _megatron_groups(tp, cp, ep, pp, world):
    """Megatron's own rank groups for this layout (initialize_model_parallel's generators, default order)."""
    from megatron.core.parallel_state import RankGenerator, initialize_model_parallel

    order = inspect.signature(initialize_model_parallel).parameters["order"].default
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order=order)
    return order, {"tp": dense.get_ranks("tp"), "cp": dense.get_ranks("cp"), "pp": dense.get_ranks("pp"),
                   "ep": expert.get_ranks("ep")}


@pytest.mark.parametrize("nodes, per_node, tp, cp, ep, pp, engine", [
    # upstream GLM-5 744B; its script's 64-device engines span 8 nodes (DeviceSlots.engine_parts: one part per
    # node, whole nodes), so the check below holds for them too; engines of one node are checked
    (32, 8, 4, 2, 32, 4, 8),
    (32, 8, 4, 8, 32, 8, 8),  # upstream GLM-5.2 744B
    (1, 4, 2, 1, 2, 2, 2),  # the CPU quick start at TP2 x PP2
])
def test_trainer_ranks_follow_megatron_order_on_nodes(nodes, per_node, tp, cp, ep, pp, engine):
    from slime.backends.megatron import parallel
    from slime.ray.placement_group import order_by_place

    world = nodes * per_node
    # bundles as Ray may report them: nodes and devices in scrambled creation order
    where = [(f"10.0.0.{i // per_node:03d}", [i % per_node]) for i in range(world)]
    scrambled = [where[(i * 37) % world] for i in range(world)]  # 37 is prime to every world size here
    ranks = order_by_place(scrambled, range(world))
    place = [scrambled[b] for b in ranks]  # (node, [device]) of trainer rank r
    assert place == where, "rank r must sit on node r // devices_per_node, device r % devices_per_node"

    # init_parallel leaves Megatron's order alone: TP fastest, then CP, EP, DP, PP
    assert "order" not in inspect.signature(parallel.init_parallel).parameters
    order, groups = _megatron_groups(tp, cp, ep, pp, world)
    assert order == "tp-cp-ep-dp-pp"
    node = [p[0] for p in place]
    for g in groups["tp"]:  # TP (the most communication) never leaves a node
        assert len({node[r] for r in g}) == 1 and g == list(range(g[0], g[0] + tp))
    for g in groups["pp"]:  # one rank per stage, stages world/pp ranks apart
        assert [r // (world // pp) for r in g] == list(range(pp))
    assert all(len(g) == cp for g in groups["cp"]) and all(len(g) == ep for g in groups["ep"])
    # a colocated engine of `engine` devices (trainer ranks e*engine ..) holds whole TP groups of one node
    for e in range(world // engine):
        ranks_e = set(range(e * engine, (e + 1) * engine))
        assert len({node[r] for r in ranks_e}) == 1
        assert all(set(g) <= ranks_e or not (set(g) & ranks_e) for g in groups["tp"])
