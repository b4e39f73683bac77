"""The resolved run configuration: config.json read once, "auto" decided once, a typed read-only record of what
validation resolved (slime.config.run_config), and no function of slime/config over 80 lines."""

import ast
import builtins
import dataclasses
import json
import os

import pytest

from slime.config.arguments import parse_args
from slime.config.rollout_args import rollout_defaults, validate_rollout_args

CONFIG = {"model_type": "glm4_moe", "num_hidden_layers": 4, "tie_word_embeddings": False, "n_routed_experts": 4,
          "num_experts_per_tok": 2}


def _model(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def _argv(model, *extra):
    return ["--hf-checkpoint", model, "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2", *extra]


def test_config_json_is_read_once(tmp_path, monkeypatch):
    model, opened, real_open = _model(tmp_path), [], builtins.open

    def counting_open(file, *a, **kw):
        if os.fspath(file).endswith("config.json"):
            opened.append(file)
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    args = parse_args(_argv(model, "--pipeline-model-parallel-size", "2", "--use-routing-replay"))
    assert len(opened) == 1, opened  # validation, pipeline split and routing replay share one read
    assert args.hf_config == CONFIG and args.run_config.model.hf_config == CONFIG


def test_run_config_holds_the_resolved_values(tmp_path):
    args = parse_args(_argv(_model(tmp_path), "--colocate"))
    rc = args.run_config
    assert (rc.parallel.world_size, rc.parallel.data_parallel_size, rc.parallel.tensor_model_parallel_size) == (4, 2, 2)
    assert rc.rollout.num_gpus == 4 and rc.rollout.offload_train and rc.rollout.offload_rollout  # --colocate's
    assert (rc.training.global_batch_size, rc.training.num_steps_per_rollout) == (8, 1)
    assert rc.model.model_type == "glm4_moe" and rc.checkpoint.ref_load == args.hf_checkpoint
    assert rc.rollout.engine == "auto" and rc.rollout.engine_kind == args.rollout_engine_kind
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.training.global_batch_size = 16  # type: ignore[misc]
    assert rc.check_matches(args) == []
    args.global_batch_size, args.colocate = 4, False  # a flag rewritten after validation is named
    assert rc.check_matches(args) == ["rollout.colocate", "training.global_batch_size"]


def test_auto_rollout_engine_is_resolved_once_by_validation():
    from slime.accelerator import get_accelerator
    from slime.backends.sglang.launcher import sglang_available

    args = validate_rollout_args(rollout_defaults(rollout_engine="auto"))
    want = "sglang" if get_accelerator().auto_rollout_engine() == "sglang" and sglang_available() else "embedded"
    assert args.rollout_engine_kind == want and args.rollout_engine == "auto"  # the flag keeps the user's word
    assert validate_rollout_args(rollout_defaults(rollout_engine="sglang")).rollout_engine_kind == "sglang"
    assert validate_rollout_args(rollout_defaults(rollout_engine="embedded")).rollout_engine_kind == "embedded"
    assert rollout_defaults().rollout_engine_kind is None  # unvalidated: nothing decided yet


def test_no_function_of_the_configuration_over_80_lines():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slime", "config")
    long = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            long += [f"{name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, "split by concern: " + ", ".join(long)
