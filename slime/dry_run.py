"""`python train.py ARGS --dry-run`: what the run would be, from the flags and config.json alone.

No weights are read and Ray is not started. Prints the model, the resolved parallel layout and the
pipeline split, the placement of trainer ranks and rollout engines, the optimizer schedule, warnings
(paths that do not exist yet, features this trainer cannot run yet, flags this device cannot honor,
SGLang options the embedded engine ignores) and the per-device memory plan of `slime.plan`.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

Printer = Callable[[str], None]

PLAN_DEVICE_DEFAULT = "h200"


def missing_paths(args: argparse.Namespace) -> list[str]:
    """Checkpoint, data and output paths that do not exist yet (a dry run on a laptop has none of them)."""
    from slime.config.rollout_args import eval_datasets

    out = []
    for flag, path in (("--ref-load", args.ref_load), ("--load", args.load), ("--save", args.save),
                       ("--prompt-data", args.prompt_data), ("--output-dir", args.output_dir)):
        if path and not os.path.exists(path):
            out.append(f"{flag} {path} does not exist yet")
    for name, path in eval_datasets(args):
        if not os.path.exists(path):
            out.append(f"--eval-prompt-data {name} {path} does not exist yet")
    return out


def prompt_file_problem(args: argparse.Namespace) -> str | None:
    """What the run's preflight would refuse in --prompt-data (keys, labels, JSON), when the file is here: a dry
    run elsewhere (a laptop, a login node) only warns that it does not exist yet."""
    from slime.config.preflight import check_prompts
    from slime.config.preflight_report import PreflightError, PreflightReport

    path = (args.prompt_data or "").split("@[")[0]
    if not path or not os.path.exists(path):
        return None
    try:
        check_prompts(args, PreflightReport())
    except PreflightError as e:
        return str(e)
    return None


def pipeline_split(args: argparse.Namespace, num_layers: int) -> list[int]:
    """Decoder layers per pipeline stage (first/last stages as given, the rest even): the trainer's split."""
    from slime.backends.megatron.pipeline import stage_layer_counts

    return list(stage_layer_counts(num_layers, args.pipeline_model_parallel_size,
                                   args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers))


def _placement(args: argparse.Namespace) -> list[str]:
    rollout = args.run_config.rollout  # the placement as validation resolved it
    engines = rollout.num_gpus // rollout.num_gpus_per_engine
    lines = [f"trainer: {args.actor_num_nodes} node(s) x {args.actor_num_gpus_per_node} devices = "
             f"{args.run_config.parallel.world_size} ranks",
             f"rollout: {engines} engine(s) x {rollout.num_gpus_per_engine} devices = {rollout.num_gpus} "
             f"devices, {'colocated with the trainer' if rollout.colocate else 'on their own devices'}"]
    per_engine, per_node = rollout.num_gpus_per_engine, rollout.num_gpus_per_node
    if engines and per_engine > per_node:  # whole nodes each (placement_group.engine_parts)
        lines[-1] += f"; each engine over {per_engine // per_node} nodes (SGLang --nnodes {per_engine // per_node})"
    for m in args.sglang_deployments or ():
        groups = ", ".join(f"{g.worker_type} {g.num_gpus // g.num_gpus_per_engine}x{g.num_gpus_per_engine}"
                           for g in m.groups)
        lines.append(f"  --sglang-config model {m.name!r}: {groups}")
    if args.prefill_num_servers:
        lines.append(f"  PD: {args.prefill_num_servers} prefill engine(s), {engines - args.prefill_num_servers} decode")
    return lines


def _schedule(args: argparse.Namespace) -> str:
    from slime.backends.megatron.lr_schedule import schedule_steps

    from slime.backends.megatron.lr_schedule import steps_per_rollout

    warmup, decay, total = schedule_steps(args)
    return (f"optimizer {args.optimizer}: lr {args.lr:g} -> min {args.min_lr:g}, {args.lr_decay_style} decay over "
            f"{decay} steps, {warmup} warmup; {total} optimizer steps in the run "
            f"({args.num_rollout} rollouts x {steps_per_rollout(args)} per rollout)")


def memory_plan(args: argparse.Namespace) -> str:
    """slime.plan's per-device table for this layout, or one line why it is unavailable."""
    from slime.plan.devices import get_device
    from slime.plan.estimate import plan
    from slime.plan.layout import Layout, RolloutSettings, TrainSettings
    from slime.plan.model import ModelShape
    from slime.plan.report import plan_text

    run = args.run_config  # config.json as validation read it, the resolved layout and placement
    hf, par, rollout = run.model.hf_config, run.parallel, run.rollout
    try:
        model = ModelShape.from_config(dict(hf, _name=os.path.basename(os.path.abspath(run.model.hf_checkpoint))))
        device = get_device(args.dry_run_device or PLAN_DEVICE_DEFAULT)
        # the trainer trains in the checkpoint's dtype unless --bf16 (real GLM/Qwen checkpoints are bf16)
        bf16 = run.model.bf16 or (hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16"
        ts = TrainSettings(
            max_tokens_per_gpu=args.max_tokens_per_gpu or (args.rollout_max_response_len + 2048),
            recompute="full" if args.recompute_granularity == "full" else "none",
            distributed_optimizer=bool(args.use_distributed_optimizer),
            optimizer_cpu_offload=bool(args.optimizer_cpu_offload), with_mtp=bool(args.enable_mtp_training),
            param_bytes=2 if bf16 else 4, master_bytes=4 if bf16 else 0)
        rs = RolloutSettings(
            rollout_batch_size=rollout.batch_size or 1, n_samples_per_prompt=rollout.n_samples_per_prompt,
            max_prompt_len=rollout.max_prompt_len or 2048, max_response_len=args.rollout_max_response_len,
            devices_per_engine=rollout.num_gpus_per_engine, rollout_devices=rollout.num_gpus,
            colocate=rollout.colocate, offload=rollout.offload_train and rollout.offload_rollout,
            mem_fraction_static=args.sglang_mem_fraction_static or 0.8,
            update_weight_buffer_bytes=args.update_weight_buffer_size,
            global_batch_size=run.training.global_batch_size)
        layout = Layout(args.actor_num_nodes, args.actor_num_gpus_per_node, tp=par.tensor_model_parallel_size,
                        pp=par.pipeline_model_parallel_size, ep=par.expert_model_parallel_size,
                        cp=par.context_parallel_size, etp=par.expert_tensor_parallel_size,
                        sequence_parallel=par.sequence_parallel or None)  # None: on at TP > 1
        return f"memory plan on {device.name} (--dry-run-device):\n" + plan_text(plan(model, layout, device, ts, rs))
    except ValueError as e:
        return f"memory plan: unavailable ({e})"


def warnings(args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> list[str]:
    out = [f"warning: {m}" for m in missing_paths(args)]
    out += [f"warning: would fail at start-up: {m}" for m in args.dry_run_limits]
    return out + runtime_warnings(args, parser)


def runtime_warnings(args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> list[str]:
    """What a real run says before Ray starts: flags this device or engine cannot honor (one line each)."""
    from slime.backends.sglang.launcher import sglang_available
    from slime.config.sglang_args import embedded_ignored_line
    from slime.config.megatron_flags import implementation_warning, not_yet_honored

    out = []
    impl = implementation_warning(args)
    if impl:
        out.append(impl)
    if parser is not None:
        pending = not_yet_honored(parser, args)
        if pending:
            out.append("warning: accepted but not acted on yet: " + ", ".join(pending))
    kind = args.rollout_engine_kind  # "auto" resolved once, by the configuration (slime.config.rollout_flags)
    if kind == "sglang" and not sglang_available():
        out.append("warning: rollout engine: --rollout-engine sglang but sglang is not installed; install it or use "
                   "--rollout-engine embedded")
        kind = None
    if kind == "sglang" and (args.sglang_config or args.prefill_num_servers):
        out.append("warning: --sglang-config/--prefill-num-servers are validated, but this launcher starts regular "
                   "(not prefill/decode) engines; PD disaggregation is not launched yet")
    if kind == "embedded":
        ignored = embedded_ignored_line(args)
        if ignored:
            out.append(f"warning: {ignored}")
        if args.rollout_num_gpus_per_engine != 1:
            out.append(f"warning: the embedded engine runs --rollout-num-gpus-per-engine "
                       f"{args.rollout_num_gpus_per_engine} as that many processes, each with all the weights "
                       f"(its linear layers' work is split, not its memory: docs/rollout.md); SGLang divides both"
                       + ("" if args.colocate else "; without --colocate it needs SGLang"))
    from slime.config.upstream_differences import upstream_difference_warnings
    from slime.utils.tracking import tracking_warnings

    out += tracking_warnings(args)
    return out + upstream_difference_warnings(args)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None, out: Printer = print) -> int:
    run_config = args.run_config  # what validation resolved: config.json as read once, the layout, the batches
    cfg, par, training = run_config.model.hf_config, run_config.parallel, run_config.training
    from slime.config.model_args import model_args_given, text_model_config

    text = text_model_config(cfg)  # a vision-language checkpoint (Qwen3.5): its text model is what trains
    out(f"dry run: flags checked against {os.path.join(args.hf_checkpoint, 'config.json')} (no weights, no Ray)")
    out(f"model: {cfg.get('model_type')}, {text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}; "
        + ("MODEL_ARGS agree with config.json" if model_args_given(args) else "no MODEL_ARGS given"))
    from slime.backends.megatron.checkpoint.check import check_run_checkpoints
    from slime.backends.megatron.checkpoint.layout import CheckpointFormatError

    try:  # torch_dist --load / --ref-load: their layout and weight keys vs the model
        lines, unreadable = check_run_checkpoints(args, cfg, unreadable_warns=True)
    except CheckpointFormatError as e:
        out(f"train.py: error: {e}")
        return 2
    for w in unreadable:
        out(f"warning: {w}")
    for line in lines:
        out(f"checkpoint: {line}")
    problem = prompt_file_problem(args)
    if problem:
        out(f"train.py: error: {problem}")
        return 2
    try:
        stages = pipeline_split(args, int(text.get("num_hidden_layers", 0)))
    except ValueError as e:
        out(f"train.py: error: {e}")
        return 2
    out(f"layout: world {par.world_size} = dp {par.data_parallel_size} x tp {par.tensor_model_parallel_size} x "
        f"pp {par.pipeline_model_parallel_size} x cp {par.context_parallel_size}; experts: ep "
        f"{par.expert_model_parallel_size} x etp {par.expert_tensor_parallel_size}; sequence parallel "
        f"{'on' if par.sequence_parallel or par.tensor_model_parallel_size > 1 else 'off'}; layers per pipeline stage {stages}")
    for line in _placement(args):
        out(f"placement: {line}")
    micro = (f"dynamic micro-batches of {training.max_tokens_per_gpu} tokens" if training.use_dynamic_batch_size
             else f"micro-batch {training.micro_batch_size}")
    out(f"batches: {run_config.rollout.batch_size} prompts x {run_config.rollout.n_samples_per_prompt} samples per "
        f"rollout, global batch {training.global_batch_size}, {micro}")
    out(_schedule(args))
    for w in warnings(args, parser):
        out(w)
    out(memory_plan(args))
    out("dry run OK")
    return 0
