"""The `train.py` command line: slime's flag names, grouped help, one-line validation errors.

"GPU" in a flag name means one accelerator device (GPU, NPU, or a CPU worker slot on CPU).
Rollout and data flags come from `slime.config.rollout_args.add_rollout_arguments`; upstream slime's
Megatron flags from `slime.config.model_args` (MODEL_ARGS, checked against config.json) and
`slime.config.megatron_flags`; any `--sglang-*` option from `slime.config.sglang_args`.
`--dry-run` validates everything against config.json alone and prints the plan (`slime.dry_run`).
Every flag's default is stated once, here or in those modules; code reads `args.<name>` directly.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from typing import Sequence

from slime.config.parser_helpers import ArgumentError, add_argument_once, limit as _limit, require as _require
from slime.utils.help_format import DefaultsOnceFormatter
from slime.utils.mask_utils import LOSS_MASK_TYPES

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
UPDATE_WEIGHT_MODES = ("auto", "ipc", "distributed")
CKPT_FORMATS = ("torch_dist",)


_add = add_argument_once


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}); pass an object like '{{\"NAME\": \"value\"}}'") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of names to values")
    return {k: str(v) for k, v in value.items()}


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster", "Ray placement of trainer and rollout engines")
    _add(g, parser, "--actor-num-nodes", type=int, default=1, help="nodes for the trainer")
    _add(g, parser, "--actor-num-gpus-per-node", type=int, default=1,
         help="trainer ranks per node (one accelerator device each; CPU worker slots on CPU)")
    _add(g, parser, "--rollout-num-gpus", type=int, default=None,
         help="devices for rollout engines (default: the trainer's devices when --colocate, else 1)")
    _add(g, parser, "--rollout-num-gpus-per-engine", type=int, default=1, help="devices per engine (engine TP size)")
    _add(g, parser, "--num-gpus-per-node", type=int, default=None,
         help="devices per node where the rollout engines run: an engine larger than that spans whole nodes "
              "(SGLang --nnodes); with --colocate it is the trainer's (default: --actor-num-gpus-per-node)")
    _add(g, parser, "--colocate", action="store_true", help="trainer and engines share the same devices")
    # upstream's meaning: on by default with --colocate (the trainer and engines take turns on the devices)
    _add(g, parser, "--offload-train", action=argparse.BooleanOptionalAction, default=None,
         help="release trainer memory while rolling out (default: on with --colocate)")
    _add(g, parser, "--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
         help="release engine memory while training (default: on with --colocate)")
    _add(g, parser, "--offload", action="store_true", help="both --offload-train and --offload-rollout")
    _add(g, parser, "--train-env-vars", type=_json_object, default={},
         help='environment variables of the trainer ranks, a JSON object (e.g. \'{"PYTORCH_CUDA_ALLOC_CONF": '
              '"expandable_segments:True"}\')')
    _add(g, parser, "--num-cpus", type=int, default=None,
         help="CPUs Ray may use when this process starts it (default: all)")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints")
    _add(g, parser, "--hf-checkpoint", type=str, default=None, help="HF model dir: initial weights, tokenizer, config")
    _add(g, parser, "--ref-load", type=str, default=None,
         help="reference model for KL: an HF dir or a torch_dist checkpoint dir (default: --hf-checkpoint)")
    _add(g, parser, "--ref-ckpt-step", type=int, default=None,
         help="--ref-load's iteration (rollout id) to load from a --save root, instead of its latest")
    _add(g, parser, "--load", type=str, default=None,
         help="resume from this torch_dist checkpoint dir (--save's); an HF dir gives initial weights; "
              "a new or empty dir starts from --hf-checkpoint")
    _add(g, parser, "--save", type=str, default=None, help="write torch_dist checkpoints here")
    _add(g, parser, "--save-interval", type=int, default=None, help="save every N rollouts (and after the last)")
    _add(g, parser, "--save-hf", type=str, default=None,
         help="also export HF weights to this dir at each save ('{rollout_id}' is substituted)")


def _add_dist_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint format and resume (Megatron's flags)")
    _add(g, parser, "--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
         help="Megatron's distributed checkpoint format: loads at any TP/EP/DP/PP layout")
    _add(g, parser, "--async-save", action="store_true",
         help="write each checkpoint's files in the background while training goes on (published once written, "
              "at the latest before the next save and at the end of the run)")
    _add(g, parser, "--no-load-optim", action="store_true", help="resume without the optimizer state")
    _add(g, parser, "--no-load-rng", action="store_true", help="resume without the RNG state")
    _add(g, parser, "--finetune", action="store_true",
         help="take only the model weights from --load; start at rollout 0 with fresh optimizer and data order")
    # Megatron-LM's switches to the model-space optimizer form, which is the one this trainer always saves (and
    # the one of upstream's it reads: checkpoint_foreign); accepted so upstream scripts that pass them run.
    _add(g, parser, "--dist-ckpt-optim-fully-reshardable", action="store_true",
         help="always on here: the optimizer state is saved in model space (fully_reshardable), loadable at any layout")
    _add(g, parser, "--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
         help="always on here: that state is gathered on DP rank 0 in host memory over gloo")


def _validate_checkpoint_dirs(args: argparse.Namespace, only_existing: bool = False) -> None:
    """--load / --ref-load hold a format the trainer reads (one line naming what was expected otherwise)."""
    from slime.backends.megatron import checkpoint_layout as L

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


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training batches")
    _add(g, parser, "--num-rollout", type=int, default=None, help="total rollout iterations")
    _add(g, parser, "--update-weights-interval", type=int, default=1,
         help="train_async.py: push the trainer's weights to the engines after every N-th rollout (train.py: every one)")
    _add(g, parser, "--keep-old-actor", action="store_true",
         help="old log-probs from a host copy of the weights the engines generated with (upstream's queue: with "
              "--update-weights-interval 1 the copy trails the synced weights by one sync), not the current weights")
    _add(g, parser, "--num-steps-per-rollout", type=int, default=None,
         help="optimizer steps per rollout (default 1): sets --global-batch-size, which must then agree")
    _add(g, parser, "--global-batch-size", type=int, default=None,
         help="samples per optimizer step (default: rollout-batch-size * n-samples-per-prompt / num-steps-per-rollout)")
    _add(g, parser, "--micro-batch-size", type=int, default=1, help="samples per micro-batch (without dynamic batching)")
    _add(g, parser, "--use-dynamic-batch-size", action="store_true",
         help="pack micro-batches up to --max-tokens-per-gpu instead of a fixed sample count")
    _add(g, parser, "--max-tokens-per-gpu", type=int, default=None, help="token budget of one packed micro-batch")
    _add(g, parser, "--log-probs-max-tokens-per-gpu", type=int, default=None,
         help="token budget of a packed micro-batch in the log-prob passes (no grad, so it may exceed "
              "--max-tokens-per-gpu; default: --max-tokens-per-gpu)")
    _add(g, parser, "--log-probs-chunk-size", type=int, default=None,
         help="tokens per chunk when computing log-probs over the vocabulary (bounds memory)")
    _add(g, parser, "--bf16", action="store_true", help="train in bfloat16 (default: the checkpoint's float32)")
    _add(g, parser, "--calculate-per-token-loss", action="store_true",
         help="average the loss over all tokens of the step (default: mean per sample, then over samples)")
    _add(g, parser, "--balance-by-flops", action="store_true",
         help="with --use-dynamic-batch-size: as many micro-batches as the token budget needs, balanced by "
              "forward FLOPs (coeff * L + L^2 per sequence, Karmarkar-Karp) rather than packed to the budget; "
              "implies --balance-data")
    _add(g, parser, "--balance-data", action="store_true",
         help="spread each step's samples over data-parallel ranks by token count (largest first) instead of in order")
    _add(g, parser, "--train-backend", choices=("megatron",), default="megatron",
         help="training backend (upstream's; Megatron-core is the one here)")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism (Megatron)")
    _add(g, parser, "--tensor-model-parallel-size", type=int, default=1)
    _add(g, parser, "--expert-model-parallel-size", type=int, default=1)
    _add(g, parser, "--pipeline-model-parallel-size", type=int, default=1)
    _add(g, parser, "--expert-tensor-parallel-size", type=int, default=1,
         help="TP inside each routed expert; the GLM model keeps experts whole (1 only)")
    _add(g, parser, "--context-parallel-size", type=int, default=1,
         help="split each sequence over ranks; not implemented for the GLM model yet (1 only)")
    _add(g, parser, "--sequence-parallel", action="store_true")


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline parallel (Megatron's 1F1B schedule)")
    _add(g, parser, "--decoder-first-pipeline-num-layers", type=int, default=None,
         help="decoder layers on the first pipeline stage (the others split the rest evenly)")
    _add(g, parser, "--decoder-last-pipeline-num-layers", type=int, default=None,
         help="decoder layers on the last pipeline stage (the others split the rest evenly)")
    _add(g, parser, "--num-layers-per-virtual-pipeline-stage", type=int, default=None,
         help="interleaved (virtual) pipeline stages; not supported by this trainer (1F1B only)")
    _add(g, parser, "--num-virtual-stages-per-pipeline-rank", type=int, default=None,
         help="interleaved (virtual) pipeline stages; not supported by this trainer (1F1B only)")


def _validate_pipeline(args: argparse.Namespace) -> None:
    """PP layout: the stage split against the checkpoint's layer count (config.json), no virtual stages, no
    tied embeddings across stages; --enable-mtp-training needs the checkpoint's MTP layers."""
    for flag in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        _require(getattr(args, flag, None) is None,
                 f"--{flag.replace('_', '-')}: interleaved virtual pipeline stages are not supported by this trainer; "
                 "drop the flag (pipeline stages run Megatron's 1F1B schedule)")
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    config = os.path.join(args.hf_checkpoint, "config.json")
    if not os.path.isfile(config):
        return  # the loader reports the missing config.json
    import json

    from slime.backends.megatron.pipeline import stage_layer_counts

    with open(config) as f:
        hf = json.load(f)
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
        stage_layer_counts(layers, pp, first, last)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


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


def _add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer (Adam)")
    _add(g, parser, "--lr", type=float, default=1e-6)
    _add(g, parser, "--weight-decay", type=float, default=0.0)
    _add(g, parser, "--clip-grad", type=float, default=1.0, help="max global grad norm (0 = off)")
    _add(g, parser, "--adam-beta1", type=float, default=0.9)
    _add(g, parser, "--adam-beta2", type=float, default=0.98)
    _add(g, parser, "--adam-eps", type=float, default=1e-8)
    _add(g, parser, "--seed", type=int, default=1234)
    _add(g, parser, "--reset-optimizer-states", action="store_true",
         help="zero Adam's moments and step count at the start of every rollout's training")
    _add(g, parser, "--only-train-params-name-list", type=str, nargs="*", default=None,
         help="regular expressions (re.search) over Megatron parameter names to train; every other parameter is "
              "frozen (e.g. `experts`, `layers\\.2[0-3]\\.`)")
    _add(g, parser, "--freeze-params-name-list", type=str, nargs="*", default=None,
         help="regular expressions over Megatron parameter names to freeze (e.g. `embedding output_layer`)")


RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")  # what the GLM layers implement (docs/training.md)


def _add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-core's memory toolkit: distributed optimizer, activation recompute, optimizer CPU offload."""
    g = parser.add_argument_group("memory (Megatron distributed optimizer, recompute, optimizer offload)")
    _add(g, parser, "--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=True,
         help="shard fp32 main params and Adam state over data-parallel ranks (grads reduce-scattered, params "
              "all-gathered); --no-use-distributed-optimizer keeps a full optimizer on every rank")
    _add(g, parser, "--overlap-grad-reduce", action="store_true",
         help="launch each grad bucket's reduction during backward (asynchronous collectives)")
    _add(g, parser, "--overlap-param-gather", action="store_true",
         help="distributed optimizer: all-gather updated params during the next forward (needs --overlap-grad-reduce)")
    _add(g, parser, "--recompute-granularity", choices=("full", "selective"), default=None,
         help="activation recompute: full = whole layers (with --recompute-method/--recompute-num-layers), "
              "selective = the --recompute-modules parts of each layer")
    _add(g, parser, "--recompute-method", choices=("uniform", "block"), default=None,
         help="full recompute: uniform = checkpoint every chunk of --recompute-num-layers layers; block = "
              "only the first --recompute-num-layers layers of each pipeline stage")
    _add(g, parser, "--recompute-num-layers", type=int, default=None, help="layers per recompute chunk (see above)")
    _add(g, parser, "--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
         help="selective recompute: which parts (default core_attn); mlp = dense MLPs, moe = whole MoE layers")
    _add(g, parser, "--optimizer-cpu-offload", action="store_true",
         help="Adam state and update on the host (Megatron's HybridDeviceOptimizer); nothing moves on the CPU device")
    _add(g, parser, "--optimizer-offload-fraction", type=float, default=1.0,
         help="with --optimizer-cpu-offload: fraction of the optimizer state moved to the host")
    _add(g, parser, "--overlap-cpu-optimizer-d2h-h2d", action="store_true",
         help="with --optimizer-cpu-offload: overlap the grad/param copies with the host optimizer (per-param streams)")
    _add(g, parser, "--use-precision-aware-optimizer", action="store_true",
         help="Megatron's precision-aware optimizer (main params / moments kept by the optimizer; needs the "
              "distributed optimizer, and TransformerEngine's FusedAdam unless --optimizer-cpu-offload)")


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


def _add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weight sync (trainer -> engines)")
    _add(g, parser, "--update-weight-buffer-size", type=int, default=512 * 1024**2,
         help="bytes per exported weight bucket")
    _add(g, parser, "--update-weight-mode", choices=UPDATE_WEIGHT_MODES, default="auto",
         help="ipc: shared device memory (colocated); distributed: broadcast over a collective group; "
              "auto: ipc when colocated and the device supports it")
    _add(g, parser, "--check-weight-sync", type=int, choices=(0, 1), default=1,
         help="compare a weight checksum on trainer and engine after every sync (1 = on)")
    _add(g, parser, "--check-weight-update-equal", action="store_true",
         help="upstream's check that the engines hold the trainer's weights after an update: "
              "--check-weight-sync 1 (the checksum comparison)")
    _add(g, parser, "--update-weight-timeout", type=float, default=600.0,
         help="seconds a weight-update group may take to form or a broadcast / payload hand-over to finish "
              "before the sync is aborted (every engine is resumed either way)")


def _add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm")
    _add(g, parser, "--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo")
    _add(g, parser, "--disable-grpo-std-normalization", action="store_true",
         help="grpo/gspo: subtract the group mean only")
    _add(g, parser, "--eps-clip", type=float, default=0.2, help="PPO clip: ratio >= 1 - eps-clip")
    _add(g, parser, "--eps-clip-high", type=float, default=None, help="PPO clip: ratio <= 1 + eps-clip-high (default eps-clip)")
    _add(g, parser, "--eps-clip-c", type=float, default=None, help="dual clip bound for negative advantages (> 1)")
    _add(g, parser, "--use-kl-loss", action="store_true", help="add a KL(actor || reference) loss term")
    _add(g, parser, "--kl-loss-coef", type=float, default=0.0)
    _add(g, parser, "--kl-loss-type", choices=KL_LOSS_TYPES, default="k1",
         help="KL estimator of --use-kl-loss and of --kl-coef's reward shaping (upstream's default k1)")
    _add(g, parser, "--use-unbiased-kl", action="store_true",
         help="weight the KL loss by the importance ratio pi_theta / pi_old (an unbiased estimate off-policy)")
    _add(g, parser, "--kl-coef", type=float, default=0.0,
         help="KL penalty folded into token rewards (reinforce_plus_plus*, ppo)")
    _add(g, parser, "--loss-type", choices=("policy_loss", "custom_loss", "sft_loss"), default="policy_loss",
         help="custom_loss: the loss of --custom-loss-function-path (upstream's contract, docs/plugins.md); "
              "sft_loss: negative log-likelihood of the loss-masked response tokens (docs/training.md)")
    _add(g, parser, "--loss-mask-type", choices=LOSS_MASK_TYPES, default="qwen",
         help="chat template family slime.rollout.sft_rollout masks with: assistant turns are trained")
    _add(g, parser, "--disable-compute-advantages-and-returns", action="store_false",
         dest="compute_advantages_and_returns", help="skip advantages (SFT, or a custom loss that needs none)")
    _add(g, parser, "--debug-train-only", action="store_true",
         help="start no rollout engine and sync no weights: the rollout function makes the data (SFT)")
    _add(g, parser, "--num-epoch", type=int, default=None,
         help="passes over --prompt-data; sets --num-rollout to num_epoch * prompts // rollout-batch-size")
    _add(g, parser, "--custom-loss-function-path", type=str, default=None,
         help="module.fn(args, batch, logits, sum_of_sample_mean) -> (loss, log dict), with --loss-type custom_loss")
    _add(g, parser, "--custom-tis-function-path", type=str, default=None,
         help="with --use-tis: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, "
              "response_lengths) -> (pg_loss, loss_masks, metrics), replacing the built-in truncated IS weights")
    _add(g, parser, "--custom-pg-loss-reducer-function-path", type=str, default=None,
         help="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(pg_loss) "
              "-> scalar: reduces the policy-gradient term instead of the per-sample mean (e.g. Dr.GRPO)")
    _add(g, parser, "--rollout-data-postprocess-path", type=str, default=None,
         help="fn(args, rollout_id, rollout_data) on each train rank after the log-probs and advantages, before "
              "training: may change rollout_data's per-sample entries (e.g. loss_masks, advantages)")
    _add(g, parser, "--custom-megatron-init-path", type=str, default=None,
         help="fn(args) once the model, optimizer and LR schedule exist (upstream's Megatron hook)")
    _add(g, parser, "--custom-megatron-before-log-prob-hook-path", type=str, default=None,
         help="fn(args, model, store_prefix) before each log-prob pass ('' old policy, 'ref_' reference)")
    _add(g, parser, "--custom-megatron-before-train-step-hook-path", type=str, default=None,
         help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each optimizer step")
    _add(g, parser, "--gamma", type=float, default=1.0, help="discount of reinforce_plus_plus returns and ppo's GAE")
    _add(g, parser, "--normalize-advantages", action="store_true",
         help="whiten advantages over the rollout's response tokens (loss-masked mean 0, std 1); "
              "reinforce_plus_plus* always whiten (upstream requires this flag with them)")
    _add(g, parser, "--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    _add(g, parser, "--use-tis", action="store_true",
         help="truncated importance sampling: weight the loss by min(pi_old / pi_rollout, tis-clip)")
    _add(g, parser, "--tis-clip", type=float, default=2.0)
    _add(g, parser, "--tis-clip-low", type=float, default=0.0)
    _add(g, parser, "--use-rollout-logprobs", action="store_true",
         help="use the engine's log-probs as the old policy instead of recomputing them")
    _add(g, parser, "--disable-rewards-normalization", dest="rewards_normalization", action="store_false",
         help="grpo/gspo/reinforce_plus_plus_baseline: no per-group reward normalization (raw rewards)")
    _add(g, parser, "--use-opsm", action="store_true",
         help="off-policy sequence masking: drop the policy loss of a sample with negative advantage whose "
              "mean log-ratio old - current exceeds --opsm-delta")
    _add(g, parser, "--opsm-delta", type=float, default=1e-4, help="--use-opsm's bound on the sample's mean KL")
    _add(g, parser, "--use-rollout-entropy", action="store_true",
         help="compute the old policy's per-token entropy in its log-prob pass: rollout_data['entropy'] for the "
              "hooks (e.g. entropy-based loss masks), rollout/entropy in the metrics")
    _add(g, parser, "--get-mismatch-metrics", action="store_true",
         help="report the trainer / engine log-prob mismatch per step: train/tis (old / rollout ratio), "
              "train/tis_clipfrac (outside [--tis-clip-low, --tis-clip]), train/tis_abs, train/ois (current / old)")
    _add(g, parser, "--ref-update-interval", type=int, default=None,
         help="every N rollouts the reference policy becomes a copy of the actor (default: it stays fixed)")
    _add(g, parser, "--use-stateless-adam", action="store_true",
         help="Adam without moments carried across steps (each step starts from zero moments: upstream's "
              "StatelessAdam update, sign-like steps); needs --optimizer adam")
    _add(g, parser, "--custom-advantage-function-path", type=str, default=None,
         help="fn(args, rollout_data) replacing the advantage estimator on each train rank: rollout_data holds "
              "this rank's per-sample log_probs, ref_log_probs, rollout_log_probs, values, kl, loss_masks (tensors), "
              "rewards, response_lengths, total_lengths; the function sets rollout_data['advantages'] (and "
              "'returns') to per-sample tensors")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    _add(g, parser, "--output-dir", type=str, default="outputs/run", help="metrics.jsonl, logs and reports")


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    from slime.config.rollout_flags import add_rollout_arguments

    add_rollout_arguments(parser)


def _add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dry run")
    _add(g, parser, "--dry-run", action="store_true",
         help="validate every flag against --hf-checkpoint's config.json (no weights, no Ray), print the parallel "
              "layout, placement and per-device memory plan, and exit; missing checkpoint/data/output paths are warnings")
    _add(g, parser, "--dry-run-device", type=str, default=None,
         help="device profile for the dry run's memory plan (python -m slime.plan --list-devices; default h200)")


class OneLineErrorParser(argparse.ArgumentParser):
    """train.py's parser: no abbreviations (`--num-roll` is not `--num-rollout`, as in Megatron's parser), an
    error is one line (no usage block) with the closest flag names for an unknown one, and a value that reads
    as a negative number (`--lr -1e-3`) is a value, not a flag."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # argparse's own pattern misses exponents and a leading "-.": "-1e-3" would be taken for a flag
        self._negative_number_matcher = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^-inf$")

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {self._suggest(message)}\n")

    def _suggest(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        known = [f for f in self._option_string_actions if f.startswith("--")]
        hints = []
        for token in message[len(prefix):].split():
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
                if close:
                    hints.append(f"{flag}: did you mean {' or '.join(close)}?")
        return message + ("; " + "; ".join(hints) if hints else "; train.py --help lists the flags")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="train.py",
        description="slime RL training: rollout -> reward -> policy update -> weight sync, on GPU, NPU or CPU.",
        formatter_class=DefaultsOnceFormatter,
    )
    _add_cluster_arguments(parser)
    _add_checkpoint_arguments(parser)
    _add_dist_checkpoint_arguments(parser)
    _add_rollout_arguments(parser)
    _add_training_arguments(parser)
    _add_parallel_arguments(parser)
    _add_pipeline_arguments(parser)
    _add_optimizer_arguments(parser)
    _add_memory_arguments(parser)
    _add_weight_sync_arguments(parser)
    _add_algorithm_arguments(parser)
    _add_output_arguments(parser)
    from slime.config.preflight import add_preflight_arguments

    add_preflight_arguments(parser)  # --overwrite-output (checked before Ray by slime.config.preflight)
    from slime.config.debug_args import add_debug_arguments

    add_debug_arguments(parser)  # --debug-rollout-only, --save/--load-debug-rollout-data, --use-fault-tolerance
    from slime.config.ppo_args import add_ppo_arguments

    add_ppo_arguments(parser)  # --advantage-estimator ppo's critic, --use-opd
    from slime.config.routing_replay_args import add_routing_replay_arguments

    add_routing_replay_arguments(parser)  # --use-routing-replay, --use-rollout-routing-replay
    from slime.config import megatron_flags, model_args

    model_args.add_model_arguments(parser)
    megatron_flags.add_schedule_arguments(parser)
    megatron_flags.add_numerics_arguments(parser)
    megatron_flags.add_mtp_arguments(parser)
    megatron_flags.add_implementation_arguments(parser)
    megatron_flags.add_logging_arguments(parser)
    from slime.config.observability_args import add_observability_arguments, add_profiler_arguments

    add_observability_arguments(parser)  # upstream's optional rollout metrics and CI checks
    add_profiler_arguments(parser)  # Megatron's profiler flags, upstream's targets for them
    from slime.config.observability_args import add_dump_arguments

    add_dump_arguments(parser)  # --save-debug-train-data, --dump-details
    _add_dry_run_arguments(parser)
    megatron_flags.add_owned_elsewhere_arguments(parser)  # last: the owners' definitions win
    return parser


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
    from slime.backends.megatron.checkpoint_layout import iter_dir

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


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill derived values and check combinations; raises ArgumentError (one line per problem)."""
    from slime.config.rollout_flags import RolloutArgumentError, validate_rollout_args

    args.dry_run_limits = []
    _require(args.hf_checkpoint is not None, "--hf-checkpoint is required: pass the HF model directory to train")
    _require(os.path.isdir(args.hf_checkpoint),
             f"--hf-checkpoint {args.hf_checkpoint!r} is not a directory; pass an HF model dir (config.json + safetensors)")
    args.hf_config = _read_hf_config(args)
    _validate_model(args)
    _set_num_rollout_from_epochs(args)
    _require(args.num_rollout is not None and args.num_rollout > 0, "--num-rollout must be a positive integer")
    for flag in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "micro_batch_size",
                 "tensor_model_parallel_size", "expert_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "expert_tensor_parallel_size",
                 "update_weight_buffer_size", "data_pad_size_multiplier", "update_weights_interval"):
        value = getattr(args, flag)
        _require(value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp, etp = args.context_parallel_size, args.expert_tensor_parallel_size
    _limit(args, etp == 1,
           f"--expert-tensor-parallel-size {etp}: the GLM model keeps each routed expert "
           "whole on one rank (expert-TP 1); use 1 and shard experts with --expert-model-parallel-size")
    _require(world % (tp * pp * cp) == 0,
             f"trainer world size {world} is not divisible by TP*PP*CP={tp * pp * cp}; change "
             "--actor-num-gpus-per-node or the parallel sizes")
    dp = world // (tp * pp * cp)
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
    args.data_parallel_size = dp
    args.world_size = world

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
    rollout_batch, n_samples = args.rollout_batch_size, args.n_samples_per_prompt
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

    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
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
    _validate_memory_args(args)
    from slime.config.observability_args import validate_profiler_args

    validate_profiler_args(args)
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save DIR")
        _require(args.save_interval >= 1, f"--save-interval must be >= 1, got {args.save_interval}")
    _require(not args.async_save or args.save is not None, "--async-save needs --save DIR")
    if args.check_weight_update_equal:
        args.check_weight_sync = 1
    if args.update_weight_mode == "ipc":
        _require(args.colocate, "--update-weight-mode ipc needs --colocate (engines must share the trainer's host devices)")
    from slime.config.ppo_args import validate_ppo_args

    validate_ppo_args(args)  # before the reference decision: --megatron-config-path may set actor flags
    from slime.config.routing_replay_args import validate_routing_replay_args

    validate_routing_replay_args(args, _read_hf_config(args) if args.use_routing_replay
                                 or args.use_rollout_routing_replay else None)
    args.use_ref_model = bool(args.use_kl_loss and args.kl_loss_coef > 0) or (
        args.kl_coef > 0 and (args.advantage_estimator.startswith("reinforce_plus_plus") or args.use_critic))
    if args.ref_load is None:
        args.ref_load = args.hf_checkpoint
    _pick_checkpoint_step(args, "ref_load", "ref_ckpt_step")
    _pick_checkpoint_step(args, "opd_teacher_load", "opd_teacher_ckpt_step")
    # under --dry-run a path that does not exist yet is a warning (slime.dry_run); an existing one must be readable
    _validate_checkpoint_dirs(args, only_existing=args.dry_run)
    try:
        validate_rollout_args(args)  # before Ray: a bad rollout flag fails here, not in an actor
    except RolloutArgumentError as e:
        raise ArgumentError(str(e)) from e
    return args


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


def parse_args(argv: Sequence[str] | None = None, add_custom_arguments=None) -> argparse.Namespace:
    """Parse and validate; bad input exits with status 2 and one line per problem, like argparse errors.
    `add_custom_arguments(parser) -> parser` adds a plugin's own flags first (upstream's hook)."""
    import sys

    from slime.config.sglang_args import SGLangConfigError, check_sglang_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    try:
        check_sglang_argv(parser, argv)
    except SGLangConfigError as e:
        parser.exit(2, f"train.py: error: {e}\n")
    args = parser.parse_args(argv)
    try:
        return validate_args(args)
    except ArgumentError as e:
        parser.exit(2, "".join(f"train.py: error: {line}\n" for line in str(e).splitlines()))
