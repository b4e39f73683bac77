"""train.py CLI: slime flag names parse, derived values, one-line validation errors."""

import pytest

from slime.config.arguments import ArgumentError, build_parser, parse_args, validate_args


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
    (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"], "do not divide into TP"),
    (["--global-batch-size", "6", "--actor-num-gpus-per-node", "4"], "not divisible by data-parallel size"),
    (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
    (["--eps-clip-c", "0.5"], "must be > 1"),
    (["--update-weight-mode", "ipc"], "needs --colocate"),
    (["--save-interval", "2"], "needs --save"),
    (["--micro-batch-size", "3"], "not divisible by --micro-batch-size"),
    (["--expert-tensor-parallel-size", "2"], "keeps each routed expert whole on one rank (expert-TP 1); use 1"),
    (["--custom-tis-function-path", "slime.utils.ppo_utils.tis_weights"], "add --use-tis"),
    (["--custom-rollout-log-function-path", "no_such_module.fn"], "--custom-rollout-log-function-path"),
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
        parse_args(_argv(tmp_path, "--advantage-estimator", "cispo_typo"))


def _junk_dir(tmp_path):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "notes.txt").write_text("not a checkpoint")
    return d


@pytest.mark.parametrize("flag", ["--load", "--ref-load"])
def test_load_dir_holding_neither_format_fails_one_line(tmp_path, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(_argv(tmp_path, flag, str(_junk_dir(tmp_path))))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert f"{flag} {tmp_path / 'junk'} holds neither a torch_dist checkpoint" in err and "an HF checkpoint" in err


def test_load_dirs_that_are_accepted(tmp_path, capsys):
    """A new or empty --load dir (the first run of --load X --save X) starts fresh; an HF dir is accepted;
    a tracker naming a missing iteration, or a missing --ref-load, is one line."""
    from slime.backends.megatron.checkpoint.layout import HF, NONE, TORCH_DIST, find_checkpoint

    assert find_checkpoint(str(tmp_path / "new")).kind == NONE
    (tmp_path / "empty").mkdir()
    assert find_checkpoint(str(tmp_path / "empty")).kind == NONE
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert find_checkpoint(str(hf)).kind == HF
    save = tmp_path / "save"
    (save / "iter_0000004").mkdir(parents=True)
    (save / "iter_0000004" / "metadata.json").write_text("{}")
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    found = find_checkpoint(str(save))
    assert (found.kind, found.iteration, found.path) == (TORCH_DIST, 4, str(save / "iter_0000004"))
    assert find_checkpoint(str(save / "iter_0000004")).iteration == 4  # one iteration directory, as upstream passes
    args = parse_args(_argv(tmp_path, "--load", str(save), "--ref-load", str(save), "--no-load-optim", "--no-load-rng",
                            "--finetune", "--ckpt-format", "torch_dist"))
    assert args.no_load_optim and args.no_load_rng and args.finetune and args.ckpt_format == "torch_dist"
    (save / "latest_checkpointed_iteration.txt").write_text("9")
    for extra, needle in ((["--load", str(save)], "names iteration 9 but"),
                          (["--ref-load", str(tmp_path / "none")], "--ref-load")):
        with pytest.raises(SystemExit):
            parse_args(_argv(tmp_path, *extra))
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err


def test_memory_flags_defaults_and_parse(tmp_path):
    args = parse_args(_argv(tmp_path))
    assert args.use_distributed_optimizer is True  # on by default, as upstream slime forces it
    assert args.recompute_granularity is None and not args.optimizer_cpu_offload
    args = parse_args(_argv(tmp_path, "--no-use-distributed-optimizer"))
    assert args.use_distributed_optimizer is False
    args = parse_args(_argv(tmp_path, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                            "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                            "2", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                            "--use-precision-aware-optimizer"))
    assert args.overlap_param_gather and args.recompute_method == "block" and args.recompute_num_layers == 2
    assert args.optimizer_offload_fraction == 1.0
    from slime.backends.megatron.optimizer import MemoryOptions

    assert MemoryOptions.from_args(args) == MemoryOptions(True, True, True, True, 1.0, True, True)  # each flag read
    args = parse_args(_argv(tmp_path, "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"))
    assert args.recompute_modules == ["core_attn", "moe"]


@pytest.mark.parametrize("extra, needle", [
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--no-use-distributed-optimizer", "--use-precision-aware-optimizer"], "needs the distributed optimizer"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "needs --optimizer-cpu-offload"),
    (["--recompute-granularity", "full"], "needs --recompute-method uniform|block and --recompute-num-layers"),
    (["--recompute-method", "uniform"], "need --recompute-granularity full|selective"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "takes --recompute-modules"),
    (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "2"], "must be in [0, 1]"),
])
def test_memory_flags_bad_combinations_one_line(tmp_path, extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(_argv(tmp_path) + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
