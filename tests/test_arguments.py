"""train.py CLI: slime flag names parse, derived values, one-line validation errors."""

import pytest

from slime.utils.arguments import ArgumentError, build_parser, parse_args, validate_args


def _argv(tmp_path, *extra):
    return ["--hf-checkpoint", str(tmp_path), "--num-rollout", "3", "--global-batch-size", "8", *extra]


def test_defaults_and_derived(tmp_path):
    args = parse_args(_argv(tmp_path, "--actor-num-gpus-per-node", "2", "--colocate"))
    assert args.world_size == 2 and args.data_parallel_size == 2
    assert args.rollout_num_gpus == 2  # colocated: engines on the trainer's devices
    assert args.eps_clip_high == args.eps_clip == 0.2
    assert args.ref_load == str(tmp_path)
    assert args.use_ref_model is False
    assert args.update_weight_mode == "auto"


def test_all_slime_flags_parse(tmp_path):
    args = parse_args(_argv(
        tmp_path, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2",
        "--rollout-num-gpus-per-engine", "2", "--offload-train", "--offload-rollout", "--save", str(tmp_path / "s"),
        "--save-interval", "2", "--save-hf", str(tmp_path / "hf"), "--micro-batch-size", "2",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "128", "--tensor-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
        "--lr", "1e-5", "--weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--seed", "7", "--update-weight-buffer-size", "1024", "--update-weight-mode", "distributed",
        "--advantage-estimator", "gspo", "--disable-grpo-std-normalization", "--eps-clip", "3e-4",
        "--eps-clip-high", "4e-4", "--eps-clip-c", "3", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--kl-loss-type", "k3", "--entropy-coef", "0.001", "--use-tis", "--tis-clip", "1.5",
        "--output-dir", str(tmp_path / "out")))
    assert args.data_parallel_size == 2 and args.tensor_model_parallel_size == 2
    assert args.eps_clip_high == pytest.approx(4e-4) and args.eps_clip_c == 3.0
    assert args.use_ref_model is True and args.kl_loss_type == "k3"
    assert args.advantage_estimator == "gspo" and args.disable_grpo_std_normalization


def test_help_groups():
    text = build_parser().format_help()
    for group in ("cluster", "checkpoints", "parallelism", "optimizer", "weight sync", "algorithm", "output"):
        assert group in text


@pytest.mark.parametrize("extra, needle", [
    (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"], "not divisible by TP*PP"),
    (["--global-batch-size", "6", "--actor-num-gpus-per-node", "4"], "not divisible by data-parallel size"),
    (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
    (["--eps-clip-c", "0.5"], "must be > 1"),
    (["--update-weight-mode", "ipc"], "needs --colocate"),
    (["--save-interval", "2"], "needs --save"),
    (["--micro-batch-size", "3"], "not divisible by --micro-batch-size"),
    (["--expert-tensor-parallel-size", "2"], "keeps each routed expert whole on one rank (expert-TP 1); use 1"),
    (["--context-parallel-size", "2"], "context parallel is not implemented for the GLM model yet; use 1"),
])
def test_bad_combinations_one_line(tmp_path, extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(_argv(tmp_path) + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_missing_checkpoint_dir(tmp_path):
    args = build_parser().parse_args(["--hf-checkpoint", str(tmp_path / "nope"), "--num-rollout", "1",
                                      "--global-batch-size", "1"])
    with pytest.raises(ArgumentError, match="is not a directory"):
        validate_args(args)


def test_bad_choice_rejected(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(_argv(tmp_path, "--advantage-estimator", "ppo"))
