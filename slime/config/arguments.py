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
import re
from typing import Sequence

from slime.config.parser_helpers import ArgumentError, add_argument_once
from slime.config.validation import (  # noqa: F401 (also this module's API)
    _pick_checkpoint_step, _set_num_rollout_from_epochs, validate_args)
from slime.utils.help_format import DefaultsOnceFormatter
from slime.utils.mask_utils import LOSS_MASK_TYPES

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
UPDATE_WEIGHT_MODES = ("auto", "ipc", "distributed", "disk")
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


def _add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weight sync (trainer -> engines)")
    _add(g, parser, "--update-weight-buffer-size", type=int, default=512 * 1024**2,
         help="bytes per exported weight bucket")
    _add(g, parser, "--update-weight-mode", choices=UPDATE_WEIGHT_MODES, default="auto",
         help="ipc: shared device memory (colocated); distributed: broadcast over a collective group; "
              "disk: a complete HF checkpoint per sync under --update-weight-disk-dir, which the engines load "
              "(upstream's --update-weight-transport disk); auto: ipc when colocated and the device supports it")
    _add(g, parser, "--update-weight-disk-dir", default=None,
         help="--update-weight-mode disk: the directory each sync writes its checkpoint to (weight_v{N:06d}), on "
              "a filesystem the trainer and every engine see at the same path")
    _add(g, parser, "--update-weight-disk-keep-files", action="store_true",
         help="--update-weight-mode disk: keep each sync's checkpoint after the engines loaded it")
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
    from slime.config.indexer_replay_args import add_indexer_replay_arguments

    add_indexer_replay_arguments(parser)  # --use-rollout-indexer-replay
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
