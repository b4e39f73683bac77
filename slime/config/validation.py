"""Validation of train.py's parsed flags: fills what they imply (defaults that depend on other flags, the
parallel layout, the rollout engine that "auto" means) and checks combinations, each problem one line
(`ArgumentError`). `validate_args` runs each concern in turn, in the order their dependencies need; the
result is the namespace with every value resolved and, read-only, `args.run_config` (slime.config.run_config).
config.json of --hf-checkpoint is read here once (`args.hf_config`); everything after reads that copy."""

from __future__ import annotations

import argparse
import os

from slime.config.parser_helpers import ArgumentError, limit as _limit, require as _require

# flags that count something and must be >= 1
POSITIVE_FLAGS = ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "micro_batch_size",
                  "tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_tensor_parallel_size", "update_weight_buffer_size",
                  "data_pad_size_multiplier", "update_weights_interval")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill derived values and check combinations; raises ArgumentError (one line per problem)."""
    from slime.config.rollout_flags import RolloutArgumentError, validate_rollout_args
    from slime.config.run_config import RunConfig

    args.dry_run_limits = []
    _validate_model_source(args)  # config.json once (args.hf_config), against the registry and MODEL_ARGS
    _validate_run_length_and_sizes(args)
    _resolve_parallel_layout(args)  # world, data-parallel size, pipeline split, Megatron's expert groups
    _resolve_placement(args)  # debug modes, rollout devices, node size, engine span, offload
    _resolve_batches(args)  # global batch, steps per rollout, micro-batches
    _validate_algorithm(args)
    _validate_memory_args(args)
    from slime.config.observability_args import validate_profiler_args

    validate_profiler_args(args)
    _validate_saving_and_sync(args)
    _resolve_reference_and_replay(args)  # PPO / OPD, routing replay, the reference model and checkpoints
    try:
        validate_rollout_args(args)  # before Ray: a bad rollout flag fails here, not in an actor
    except RolloutArgumentError as e:
        raise ArgumentError(str(e)) from e
    args.run_config = RunConfig.from_args(args)
    return args


def _validate_model_source(args: argparse.Namespace) -> None:
    _require(args.hf_checkpoint is not None, "--hf-checkpoint is required: pass the HF model directory to train")
    _require(os.path.isdir(args.hf_checkpoint),
             f"--hf-checkpoint {args.hf_checkpoint!r} is not a directory; pass an HF model dir (config.json + safetensors)")
    args.hf_config = _read_hf_config(args)
    _validate_model(args)


def _validate_run_length_and_sizes(args: argparse.Namespace) -> None:
    _set_num_rollout_from_epochs(args)
    _require(args.num_rollout is not None and args.num_rollout > 0, "--num-rollout must be a positive integer")
    for flag in POSITIVE_FLAGS:
        value = getattr(args, flag)
        _require(value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def _resolve_parallel_layout(args: argparse.Namespace) -> None:
    """args.world_size and args.data_parallel_size from the trainer's devices and the parallel sizes."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp, etp = args.context_parallel_size, args.expert_tensor_parallel_size
    _limit(args, etp == 1,
           f"--expert-tensor-parallel-size {etp}: the GLM model keeps each routed expert "
           "whole on one rank (expert-TP 1); use 1 and shard experts with --expert-model-parallel-size")
    from slime.config.parallel_sizes import check_parallel_sizes

    check_parallel_sizes(args)  # heads, groups, vocab, FFN by TP, experts by EP, layers by PP, the world: valid sizes named
    _require(world % (tp * pp * cp) == 0,
             f"trainer world size {world} is not divisible by TP*PP*CP={tp * pp * cp}; change "
             "--actor-num-gpus-per-node or the parallel sizes")
    _validate_pipeline(args)
    # Megatron's expert groups: etp * ep * pp must divide the world. Megatron-core's own check (mirrored in
    # megatron_layout, tested against it): upstream's single-node GLM-4.7-30B-A3B script asks for ep 8 x pp 2
    # on 8 devices, which Megatron refuses too; --dry-run reports it as a warning that says so.
    from slime.config.megatron_layout import ParallelLayout, megatron_refusal

    refusal = megatron_refusal(ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp))
    _limit(args, refusal is None,
           f"Megatron-core needs --expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} x "
           f"--pipeline-model-parallel-size {pp} = {etp * ep * pp} to divide the {world} trainer devices "
           f"(Megatron-core itself refuses this layout: initialize_model_parallel raises \"{refusal}\"); "
           "lower --expert-model-parallel-size or add devices")
    args.data_parallel_size = world // (tp * pp * cp)
    args.world_size = world


def _resolve_placement(args: argparse.Namespace) -> None:
    """The debug modes (which take the devices of one side away), the rollout's devices and node size, a
    colocated engine's span, and the offload defaults."""
    world = args.world_size
    from slime.config.observability_args import apply_dump_details

    apply_dump_details(args)  # --dump-details DIR: both debug dumps under DIR (before the debug modes read them)
    from slime.config.debug_args import apply_debug_modes

    apply_debug_modes(args, world)  # --load-debug-rollout-data implies --debug-train-only; --debug-rollout-only
    if args.debug_train_only:  # no engine starts, so none is given devices (upstream's meaning)
        args.rollout_num_gpus = 0
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = world if args.colocate else args.rollout_num_gpus_per_engine
    _require(args.rollout_num_gpus % args.rollout_num_gpus_per_engine == 0,
             f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
             f"{args.rollout_num_gpus_per_engine}")
    if args.colocate:
        _require(args.rollout_num_gpus <= world,
                 f"--colocate: --rollout-num-gpus {args.rollout_num_gpus} exceeds the trainer's {world} devices; lower it")
    if args.num_gpus_per_node is None:  # upstream's --num-gpus-per-node: the rollout's node size
        args.num_gpus_per_node = args.actor_num_gpus_per_node
    _require(args.num_gpus_per_node >= 1, f"--num-gpus-per-node must be >= 1, got {args.num_gpus_per_node}")
    _require(not args.colocate or args.num_gpus_per_node == args.actor_num_gpus_per_node,
             f"--colocate: the engines share the trainer's nodes, so --num-gpus-per-node {args.num_gpus_per_node} must "
             f"equal --actor-num-gpus-per-node {args.actor_num_gpus_per_node}")
    if args.colocate or args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
        _validate_colocated_engine_span(args)  # an engine over several nodes fills whole ones, split or not
    _resolve_offload(args)


def _resolve_batches(args: argparse.Namespace) -> None:
    """--global-batch-size and --num-steps-per-rollout from each other and the rollout size (upstream's rule:
    both given must agree), then their divisibility by the data-parallel size and the micro-batch."""
    rollout_batch, n_samples, dp = args.rollout_batch_size, args.n_samples_per_prompt, args.data_parallel_size
    _require(rollout_batch is None or rollout_batch >= 1, f"--rollout-batch-size must be >= 1, got {rollout_batch}")
    steps = args.num_steps_per_rollout
    _require(steps is None or steps >= 1, f"--num-steps-per-rollout must be >= 1, got {steps}")
    if steps is not None or args.global_batch_size is None:
        _require(rollout_batch is not None, "--global-batch-size or --rollout-batch-size is required")
        total, steps = rollout_batch * n_samples, steps or 1
        _require(total % steps == 0,
                 f"rollout-batch-size*n-samples-per-prompt={total} is not divisible by --num-steps-per-rollout {steps}")
        # upstream asserts that both flags agree when both are given
        _require(args.global_batch_size in (None, total // steps),
                 f"--global-batch-size {args.global_batch_size} disagrees with --num-steps-per-rollout {steps} "
                 f"(rollout-batch-size*n-samples-per-prompt {total} / {steps} = {total // steps}); pass one of them")
        args.global_batch_size = total // steps
    if rollout_batch is not None and (rollout_batch * n_samples) % args.global_batch_size == 0:
        args.num_steps_per_rollout = rollout_batch * n_samples // args.global_batch_size
    elif args.num_steps_per_rollout is None:
        args.num_steps_per_rollout = 1
    _require(args.global_batch_size % dp == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel size {dp}")
    if rollout_batch is not None:
        _require((rollout_batch * n_samples) % args.global_batch_size == 0,
                 f"rollout produces {rollout_batch * n_samples} samples, not a multiple of --global-batch-size "
                 f"{args.global_batch_size}")
    if args.use_dynamic_batch_size:
        _require(args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu > 0,
                 "--use-dynamic-batch-size needs --max-tokens-per-gpu N (the token budget of one micro-batch)")
    else:
        _require((args.global_batch_size // dp) % args.micro_batch_size == 0,
                 f"per-rank batch {args.global_batch_size // dp} is not divisible by --micro-batch-size {args.micro_batch_size}")


def _validate_algorithm(args: argparse.Namespace) -> None:
    """The policy loss's clips, KL and importance-sampling terms, the optimizer, and data balancing."""
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    # CISPO's canonical setting is --eps-clip 1.0 or more: no lower bound on the (stop-gradient) ratio
    if args.advantage_estimator == "cispo":
        _require(args.eps_clip > 0, f"--eps-clip must be > 0, got {args.eps_clip}")
    else:
        _require(0 < args.eps_clip < 1, f"--eps-clip must be in (0, 1), got {args.eps_clip}")
    _require(args.eps_clip_high > 0, f"--eps-clip-high must be > 0, got {args.eps_clip_high}")
    if args.eps_clip_c is not None:
        _require(args.eps_clip_c > 1.0, f"--eps-clip-c (dual clip) must be > 1, got {args.eps_clip_c}")
    if args.use_kl_loss:
        _require(args.kl_loss_coef >= 0, f"--kl-loss-coef must be >= 0, got {args.kl_loss_coef}")
    if args.use_tis:
        _require(args.tis_clip > 0 and args.tis_clip_low < args.tis_clip,
                 f"--tis-clip-low {args.tis_clip_low} must be below --tis-clip {args.tis_clip} (> 0)")
    _validate_optimizer(args)
    if args.balance_by_flops:  # upstream's: the FLOPs balance needs dynamic batches and balances the DP shards too
        _require(args.use_dynamic_batch_size, "--balance-by-flops needs --use-dynamic-batch-size (and --max-tokens-per-gpu)")
        args.balance_data = True
    _require(not args.use_stateless_adam or args.optimizer == "adam",
             f"--use-stateless-adam needs --optimizer adam, got --optimizer {args.optimizer}")
    _require(args.ref_update_interval is None or args.ref_update_interval >= 1,
             f"--ref-update-interval must be >= 1, got {args.ref_update_interval}")


def _validate_saving_and_sync(args: argparse.Namespace) -> None:
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save DIR")
        _require(args.save_interval >= 1, f"--save-interval must be >= 1, got {args.save_interval}")
    _require(not args.async_save or args.save is not None, "--async-save needs --save DIR")
    if args.check_weight_update_equal:
        args.check_weight_sync = 1
    if args.update_weight_mode == "ipc":
        _require(args.colocate, "--update-weight-mode ipc needs --colocate (engines must share the trainer's host devices)")
    if args.update_weight_mode == "disk":
        _require(args.update_weight_disk_dir, "--update-weight-mode disk needs --update-weight-disk-dir DIR (a "
                 "directory the trainer and every engine see at the same path)")


def _resolve_reference_and_replay(args: argparse.Namespace) -> None:
    """PPO's critic and OPD's teacher, routing replay, whether a reference model runs, and the checkpoints
    --ref-load / --opd-teacher-load name (an iteration of a --save root, readable)."""
    from slime.config.ppo_args import validate_ppo_args

    validate_ppo_args(args)  # before the reference decision: --megatron-config-path may set actor flags
    from slime.config.routing_replay_args import validate_routing_replay_args

    validate_routing_replay_args(args, args.hf_config if args.use_routing_replay
                                 or args.use_rollout_routing_replay else None)
    from slime.config.indexer_replay_args import validate_indexer_replay_args

    validate_indexer_replay_args(args)  # --use-rollout-indexer-replay: a glm5_next model, the embedded engine
    args.use_ref_model = bool(args.use_kl_loss and args.kl_loss_coef > 0) or (
        args.kl_coef > 0 and (args.advantage_estimator.startswith("reinforce_plus_plus") or args.use_critic))
    if args.ref_load is None:
        args.ref_load = args.hf_checkpoint
    _pick_checkpoint_step(args, "ref_load", "ref_ckpt_step")
    _pick_checkpoint_step(args, "opd_teacher_load", "opd_teacher_ckpt_step")
    # under --dry-run a path that does not exist yet is a warning (slime.dry_run); an existing one must be readable
    _validate_checkpoint_dirs(args, only_existing=args.dry_run)


def _validate_checkpoint_dirs(args: argparse.Namespace, only_existing: bool = False) -> None:
    """--load / --ref-load hold a format the trainer reads (one line naming what was expected otherwise)."""
    from slime.backends.megatron.checkpoint import layout as L

    def given(path: str | None) -> bool:
        return bool(path) and (not only_existing or os.path.exists(path))

    try:
        if given(args.load):
            L.find_checkpoint(args.load, "--load")
        if given(args.ref_load) and args.ref_load != args.hf_checkpoint:
            ref = L.find_checkpoint(args.ref_load, "--ref-load")
            _require(ref.kind in (L.HF, L.TORCH_DIST),
                     f"--ref-load {args.ref_load} holds no model (missing, empty or a former per-rank checkpoint); pass "
                     "an HF dir or a torch_dist checkpoint dir")
    except L.CheckpointFormatError as e:
        raise ArgumentError(str(e)) from e


def _validate_pipeline(args: argparse.Namespace) -> None:
    """PP layout: the stage split against the checkpoint's layer count (config.json), no virtual stages, no
    tied embeddings across stages; --enable-mtp-training needs the checkpoint's MTP layers."""
    for flag in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        _require(getattr(args, flag) is None,
                 f"--{flag.replace('_', '-')}: interleaved virtual pipeline stages are not supported by this trainer; "
                 "drop the flag (pipeline stages run Megatron's 1F1B schedule)")
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    hf, config = args.hf_config, os.path.join(args.hf_checkpoint, "config.json")
    if hf is None:
        return  # the loader reports the missing config.json
    from slime.backends.megatron.pipeline import stage_layer_counts
    from slime.config.model_args import text_model_config

    hf = text_model_config(hf)  # a vision-language config.json (GLM-5.3-Flash, Qwen3.5) keeps these in text_config
    layers = hf.get("num_hidden_layers")
    _require(pp == 1 or not hf.get("tie_word_embeddings"),
             f"{config}: tie_word_embeddings=true needs the embedding and the output layer on one stage: use "
             "--pipeline-model-parallel-size 1 for this checkpoint")
    if args.enable_mtp_training:
        _require(int(hf.get("num_nextn_predict_layers") or 0) > 0,
                 f"--enable-mtp-training: {config} has no num_nextn_predict_layers (no MTP layers to train); "
                 "drop the flag or use a checkpoint with MTP layers")
    if not isinstance(layers, int):
        return
    try:
        counts = stage_layer_counts(layers, pp, first, last)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _require_whole_indexer_chains(args, counts)


def _require_whole_indexer_chains(args: argparse.Namespace, counts: list[int]) -> None:
    """A DSA layer with indexer type "shared" (GLM-5, glm5_next configs that set them) reuses the top-k of the
    layer right before it, which only exists in the same forward: a stage must not start with one. Caught here,
    before Ray, instead of a RuntimeError at the first long enough sequence."""
    from slime.config.parallel_sizes import parsed_architecture

    arch = parsed_architecture(args.hf_config)  # None: the model checks report why
    if not callable(getattr(arch, "indexer_type", None)):
        return
    starts = [sum(counts[:k]) for k in range(1, len(counts))]
    split = [(k + 2, layer) for k, layer in enumerate(starts) if arch.indexer_type(layer) == "shared"]
    if split:
        stage, layer = split[0]
        raise ArgumentError(
            f"--pipeline-model-parallel-size {len(counts)} splits the layers {' + '.join(map(str, counts))}: stage "
            f"{stage} starts with layer {layer}, a DSA layer of indexer type 'shared' that reuses the top-k of layer "
            f"{layer - 1} on the stage before; set --decoder-first/last-pipeline-num-layers so that each stage starts "
            "with a 'full' DSA layer or a non-DSA layer")


def _validate_colocated_engine_span(args: argparse.Namespace) -> None:
    """A colocated engine takes consecutive trainer devices: part of one node, or whole nodes (SGLang's --nnodes,
    as upstream's GLM-5 scripts run 64-device engines on 8-device nodes; placement_group.engine_parts). Checked
    here, before Ray starts."""
    g, per_node = args.rollout_num_gpus_per_engine, args.num_gpus_per_node
    _require(per_node % g == 0 or g % per_node == 0,
             f"--rollout-num-gpus-per-engine {g}{' with --colocate' if args.colocate else ''}: an engine's devices "
             "must be on one node or fill "
             f"whole nodes, and {g} neither divides nor is a multiple of --num-gpus-per-node {per_node}; use a "
             f"divisor or a multiple of {per_node} (docs/rollout.md)")


def _validate_memory_args(args: argparse.Namespace) -> None:
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer and args.overlap_grad_reduce,
                 "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce; add them or drop it")
    if args.use_precision_aware_optimizer:
        _require(args.use_distributed_optimizer,
                 "--use-precision-aware-optimizer needs the distributed optimizer; drop --no-use-distributed-optimizer")
    if args.optimizer_cpu_offload:
        _require(0.0 <= args.optimizer_offload_fraction <= 1.0,
                 f"--optimizer-offload-fraction must be in [0, 1], got {args.optimizer_offload_fraction}")
    else:
        _require(not args.overlap_cpu_optimizer_d2h_h2d,
                 "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload; add it or drop the overlap flag")
    g, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if g is None:
        _require(method is None and n is None and args.recompute_modules is None,
                 "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute-granularity full|selective")
    elif g == "full":
        _require(method is not None and n is not None and n >= 1,
                 "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N >= 1")
        _require(args.recompute_modules is None,
                 "--recompute-modules is for --recompute-granularity selective; drop it with full recompute")
    else:
        _require(method is None and n is None,
                 "--recompute-granularity selective takes --recompute-modules, not --recompute-method/--recompute-num-layers")


def _read_hf_config(args: argparse.Namespace) -> dict | None:
    import json

    path = os.path.join(args.hf_checkpoint, "config.json")
    if not os.path.isfile(path):
        _require(not args.dry_run, f"--dry-run reads {path}; put the model's config.json there")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ArgumentError(f"{path} is not valid JSON ({e}); restore the checkpoint's config.json") from e
    _require(isinstance(cfg, dict), f"{path} must hold a JSON object")
    return cfg


def _pick_checkpoint_step(args: argparse.Namespace, load: str, step: str) -> None:
    """--ref-ckpt-step / --opd-teacher-ckpt-step: the named iteration directory of a --save root replaces the
    root, so everything downstream (key checks, loading) reads that iteration."""
    value, root = getattr(args, step), getattr(args, load)
    if value is None:
        return
    flag, load_flag = "--" + step.replace("_", "-"), "--" + load.replace("_", "-")
    _require(root is not None, f"{flag} needs {load_flag} (a --save root holding iter_XXXXXXX directories)")
    from slime.backends.megatron.checkpoint.layout import iter_dir

    path = iter_dir(root, value)
    if not os.path.isdir(path):
        have = sorted(d for d in os.listdir(root) if d.startswith("iter_")) if os.path.isdir(root) else []
        _limit(args, False, f"{flag} {value}: {path} does not exist (iterations there: {', '.join(have) or 'none'})")
        return
    setattr(args, load, path)


def _validate_model(args: argparse.Namespace) -> None:
    """config.json against the model registry, and MODEL_ARGS against config.json (every disagreement,
    one line each)."""
    from slime.config.model_args import ModelArgsError, model_arg_mismatches
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    cfg = args.hf_config
    if cfg is None:
        return
    try:
        get_family(cfg.get("model_type"))  # the family's own config checks run when the model loads
    except UnsupportedModelError as e:
        _limit(args, False, f"{args.hf_checkpoint}/config.json: {e}")
    try:
        bad = model_arg_mismatches(args, cfg)
    except ModelArgsError as e:
        raise ArgumentError(str(e)) from e
    if bad:
        raise ArgumentError("\n".join(bad))


def _set_num_rollout_from_epochs(args: argparse.Namespace) -> None:
    """--num-epoch (upstream's meaning): num_rollout = num_epoch * records in --prompt-data // rollout batch."""
    if args.num_epoch is None:
        return
    _require(args.num_epoch >= 1, f"--num-epoch must be >= 1, got {args.num_epoch}")
    _require(args.rollout_global_dataset or args.num_rollout is not None,  # upstream asserts the same
             "--num-epoch counts passes over --prompt-data, which --disable-rollout-global-dataset does not read; "
             "pass --num-rollout")
    from slime.rollout.prompt_files import PromptFileError, read_records, split_row_slice

    if not args.prompt_data or not os.path.isfile(split_row_slice(args.prompt_data)[0]):
        # Nothing to count: the input checks report the missing file (a warning under --dry-run, which
        # plans for another machine; an error at start); the plan then counts one rollout per epoch.
        if args.num_rollout is None:
            args.num_rollout = args.num_epoch
        return
    try:
        records = sum(1 for _ in read_records(args.prompt_data))
    except PromptFileError as e:
        raise ArgumentError(str(e)) from e
    args.num_rollout = args.num_epoch * records // args.rollout_batch_size
    _require(args.num_rollout > 0, f"--num-epoch {args.num_epoch}: {records} prompts make no full batch of "
                                   f"--rollout-batch-size {args.rollout_batch_size}")


def _resolve_offload(args: argparse.Namespace) -> None:
    """Upstream's offload defaults: --offload sets both; with --colocate each unset one is on, else off."""
    if args.offload:
        args.offload_train = args.offload_rollout = True
    for flag in ("offload_train", "offload_rollout"):
        if getattr(args, flag) is None:
            setattr(args, flag, bool(args.colocate))


def _validate_optimizer(args: argparse.Namespace) -> None:
    _require(args.lr >= 0 and args.weight_decay >= 0 and args.clip_grad >= 0,
             "--lr, --weight-decay and --clip-grad must be >= 0")
    _require(0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1, "--adam-beta1/--adam-beta2 must be in [0, 1)")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}]")
    _require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_warmup_fraction is not None:
        _require(0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        _require(args.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters both set the warmup; pass one")
    if args.lr_decay_iters is not None:
        _require(args.lr_decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters N")
    _require(args.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    _require(not args.fp16, "--fp16 is not supported (float16 training needs loss scaling); use --bf16")
    _require(0 <= args.hidden_dropout < 1, f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}")
    _require(args.attention_dropout == 0,
             f"--attention-dropout {args.attention_dropout}: the attention ops have no dropout; use 0.0 (every "
             "upstream run script does; --hidden-dropout is applied)")
    _require(args.moe_aux_loss_coeff == 0,
             f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}: the auxiliary load-balancing loss is not implemented; "
             "use 0 (the GLM/Qwen3 scripts do)")
    _require(args.mtp_loss_scaling_factor >= 0, "--mtp-loss-scaling-factor must be >= 0")
    _require(args.loss_type != "custom_loss" or bool(args.custom_loss_function_path),
             "--loss-type custom_loss needs --custom-loss-function-path module.fn")
    _require(not args.custom_tis_function_path or args.use_tis,
             "--custom-tis-function-path replaces --use-tis's weights: add --use-tis")
