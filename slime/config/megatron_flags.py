"""Upstream slime's Megatron training flags beyond the model shape: optimizer schedule, numerics,
dropout, MTP, implementation choices, logging. Same names and meanings as upstream's train.py
(which takes them from Megatron's parser); what this trainer does with each is in docs/flags.md.

Implementation-choice flags (`--attention-backend`, `--moe-grouped-gemm`, ...) pick kernels. Here the
kernels come from the accelerator's op table (`get_accelerator().ops`), so such a flag is honored
when the matching op runs a device implementation, and otherwise named in one warning line.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.parser_helpers import add_argument_once as _add

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
DISPATCHERS = ("allgather", "alltoall", "flex")


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer schedule (Megatron names)")
    _add(g, parser, "--optimizer", choices=("adam", "sgd"), default="adam")
    _add(g, parser, "--sgd-momentum", type=float, default=0.9)
    _add(g, parser, "--min-lr", type=float, default=0.0, help="floor of the decayed learning rate")
    _add(g, parser, "--lr-decay-style", choices=LR_DECAY_STYLES, default="constant",
         help="learning-rate decay after warmup, over --lr-decay-iters optimizer steps")
    _add(g, parser, "--lr-decay-iters", type=int, default=None,
         help="optimizer steps to decay over (default: all steps of the run, num-rollout * num-steps-per-rollout)")
    _add(g, parser, "--lr-warmup-iters", type=int, default=0, help="linear warmup steps from --lr-warmup-init")
    _add(g, parser, "--lr-warmup-fraction", type=float, default=None,
         help="warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    _add(g, parser, "--lr-warmup-init", type=float, default=0.0)
    _add(g, parser, "--lr-wsd-decay-iters", type=int, default=None, help="WSD: steps of the final decay")
    _add(g, parser, "--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
         default="exponential")
    _add(g, parser, "--start-weight-decay", type=float, default=None)
    _add(g, parser, "--end-weight-decay", type=float, default=None)
    _add(g, parser, "--weight-decay-incr-style", choices=("constant", "linear", "cosine"), default="constant")


def add_numerics_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("numerics and dropout")
    _add(g, parser, "--attention-dropout", type=float, default=0.0,
         help="dropout on attention probabilities while training (upstream inherits Megatron's 0.1; "
              "every upstream script sets 0.0, the default here)")
    _add(g, parser, "--hidden-dropout", type=float, default=0.0,
         help="dropout after attention and MLP while training (upstream: Megatron's 0.1; scripts set 0.0)")
    _add(g, parser, "--accumulate-allreduce-grads-in-fp32", action="store_true",
         help="reduce gradients in float32 (always on here: grads are reduced in fp32)")
    _add(g, parser, "--attention-softmax-in-fp32", action="store_true",
         help="attention softmax in float32 (always on here: the attention ops accumulate in fp32)")
    _add(g, parser, "--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
         action="store_false", help="do not fail a step on a non-finite loss or gradient norm")
    _add(g, parser, "--data-pad-size-multiplier", type=int, default=1,
         help="pad each packed micro-batch to a multiple of this many tokens (times TP with sequence parallel)")
    _add(g, parser, "--fp16", action="store_true", help="not supported (bf16 or fp32 only); rejected")
    _add(g, parser, "--manual-gc", action="store_true",
         help="the trainer disables Python's automatic garbage collector and collects at the start of each train "
              "call (upstream's meaning: the same collection points on every rank), and every "
              "--manual-gc-interval optimizer steps when that is > 0")
    _add(g, parser, "--manual-gc-interval", type=int, default=0,
         help="with --manual-gc: also collect every N optimizer steps (0: only at the start of each train call)")
    _add(g, parser, "--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
         help="accepted (Megatron's flag for its evaluation loop; the trainer runs no Megatron evaluation)")
    _add(g, parser, "--deterministic-mode", action="store_true",
         help="bitwise-reproducible training (Megatron's meaning): only deterministic algorithms "
              "(torch.use_deterministic_algorithms; the device's switches, e.g. cuBLAS workspace, NCCL ring), "
              "Megatron's deterministic embedding; pair with --sglang-enable-deterministic-inference for the engines")


def add_mtp_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-token prediction (MTP)")
    _add(g, parser, "--enable-mtp-training", action="store_true",
         help="train the checkpoint's MTP layer(s) with an auxiliary next-next-token loss")
    _add(g, parser, "--mtp-loss-scaling-factor", type=float, default=0.2,
         help="weight of the MTP loss (upstream slime's default 0.2; Megatron's own is 0.1)")


def add_implementation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("implementation choices",
                                  "kernels come from the accelerator's op table; a choice it cannot honor is named "
                                  "in one warning line")
    _add(g, parser, "--spec", type=str, nargs="+", default=None,
         help="Megatron layer-spec module and function; here the model follows config.json's model_type")
    _add(g, parser, "--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    _add(g, parser, "--moe-grouped-gemm", action="store_true", help="experts as one grouped matmul")
    _add(g, parser, "--moe-permute-fusion", action="store_true", help="fused token permutation for MoE")
    _add(g, parser, "--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather",
         help="how routed tokens reach their experts; this MoE layer uses an all-to-all over the EP group")
    _add(g, parser, "--moe-enable-deepep", action="store_true", help="DeepEP dispatch (with the flex dispatcher)")
    _add(g, parser, "--no-rope-fusion", dest="apply_rope_fusion", action="store_false")
    _add(g, parser, "--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
         help="Megatron's fused weight-gradient accumulation (an APEX/TE kernel) is always off here: the weight "
              "gradients accumulate in the grad buffer by plain addition")
    _add(g, parser, "--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
         help="Megatron's fused masked softmax off; the attention here is the accelerator's op either way")
    _add(g, parser, "--make-vocab-size-divisible-by", type=int, default=128,
         help="Megatron pads its vocab to this multiple; here the vocab is config.json's, unpadded")
    _add(g, parser, "--moe-router-dtype", choices=("fp32", "fp64"), default=None,
         help="precision of the router logits (default: the model's op order: GLM/DeepSeek in fp32, Qwen3-MoE in "
              "the model dtype)")
    _add(g, parser, "--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
         default="aux_loss")
    _add(g, parser, "--moe-aux-loss-coeff", type=float, default=0.0,
         help="load-balancing loss weight (0: none; a positive value is not implemented here and is rejected)")
    _add(g, parser, "--moe-router-bias-update-rate", type=float, default=1e-3,
         help="expert-bias update rate (Megatron's aux-loss-free balancing); the bias stays frozen here")
    _add(g, parser, "--moe-token-drop-policy", choices=("probs", "position"), default="probs",
         help="which tokens drop past capacity; no capacity factor here, so no token drops")
    _add(g, parser, "--enable-experimental", action="store_true", help="Megatron's experimental features")
    _add(g, parser, "--allgather-cp", action="store_true",
         help="context parallel by all-gather along the sequence (upstream's DSA layout)")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    _add(g, parser, "--use-wandb", action="store_true", help="log metrics to Weights & Biases (when installed)")
    _add(g, parser, "--wandb-project", type=str, default=None)
    _add(g, parser, "--wandb-group", type=str, default=None)
    _add(g, parser, "--wandb-team", type=str, default=None)
    _add(g, parser, "--wandb-host", type=str, default=None)
    _add(g, parser, "--wandb-key", type=str, default=None, help="API key (else the environment's login)")
    _add(g, parser, "--wandb-mode", choices=("online", "offline", "disabled"), default=None)
    _add(g, parser, "--wandb-run-id", type=str, default=None)
    _add(g, parser, "--wandb-dir", type=str, default=None)
    _add(g, parser, "--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false",
         help="use --wandb-group as the run's group and name as given (default: a random suffix is appended)")
    _add(g, parser, "--use-tensorboard", action="store_true", help="also write TensorBoard event files")
    _add(g, parser, "--tb-project-name", type=str, default=None, help="TensorBoard sub-directory")
    _add(g, parser, "--tb-experiment-name", type=str, default=None,
         help="TensorBoard sub-directory under --tb-project-name")
    _add(g, parser, "--tensorboard-dir", type=str, default=None, help="default: OUTPUT_DIR/tensorboard")


def add_owned_elsewhere_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream flags whose meaning other parts of slime define (distributed optimizer, recompute,
    pipeline stages, optimizer offload). Added last, and only where the owner has not defined them,
    so that their definition wins; until then they are accepted and `not_yet_honored` names them."""
    g = parser.add_argument_group("parallel and memory (accepted)")
    _add(g, parser, "--use-distributed-optimizer", action="store_true", default=None)
    _add(g, parser, "--recompute-granularity", choices=("full", "selective"), default=None)
    _add(g, parser, "--recompute-method", choices=("uniform", "block"), default=None)
    _add(g, parser, "--recompute-num-layers", type=int, default=None)
    _add(g, parser, "--decoder-first-pipeline-num-layers", type=int, default=None)
    _add(g, parser, "--decoder-last-pipeline-num-layers", type=int, default=None)
    _add(g, parser, "--optimizer-cpu-offload", action="store_true", default=None)
    _add(g, parser, "--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=None)
    _add(g, parser, "--use-precision-aware-optimizer", action="store_true", default=None)


OWNED_ELSEWHERE = ("use_distributed_optimizer", "recompute_granularity", "recompute_method", "recompute_num_layers",
                   "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "optimizer_cpu_offload",
                   "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer")


def not_yet_honored(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Flags given that only the placeholder group defines (their owners have not landed yet)."""
    placeholders = {a.dest: a for grp in parser._action_groups if grp.title == "parallel and memory (accepted)"
                    for a in grp._group_actions}
    return [placeholders[d].option_strings[0] for d in OWNED_ELSEWHERE
            if d in placeholders and getattr(args, d) not in (None, False)]


# implementation flag -> (is the flag's value asking for it, op whose device implementation honors it, what runs instead)
_IMPL_OPS: dict[str, tuple[Any, str | None, str]] = {
    "--attention-backend": (lambda v: v in ("flash", "fused"), "attention", "the reference attention"),
    "--moe-grouped-gemm": (bool, "grouped_matmul", "one matrix product per expert"),
    "--moe-permute-fusion": (bool, "moe_permute", "the reference permutation"),
    "--moe-enable-deepep": (bool, None, "all-to-all over the expert-parallel group"),
    "--moe-token-dispatcher-type": (lambda v: v == "flex", None, "all-to-all over the expert-parallel group"),
}


def implementation_warning(args: argparse.Namespace, ops: Any = None) -> str | None:
    """One line naming the implementation flags this device cannot honor, or None."""
    if ops is None:
        from slime.accelerator import get_accelerator

        ops = get_accelerator().ops
    missing = []
    for flag, (asked, op, instead) in _IMPL_OPS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not asked(value):
            continue
        shown = flag if value is True else f"{flag} {value}"
        if op is None:
            missing.append(f"{shown} (not integrated; {instead})")
        elif ops.source(op) == "reference":
            missing.append(f"{shown} (no device {op} kernel on {ops.accelerator_name}; {instead})")
    if not missing:
        return None
    return "warning: implementation flags not honored on this device: " + "; ".join(missing)
