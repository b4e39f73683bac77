"""Rollout, data and engine flags (slime's names). `add_rollout_arguments(parser)` is included by
train.py's parser; the rollout code reads only an argparse Namespace.

`--sglang-<flag> VALUE` options are passed to `sglang.launch_server` as `--<flag> VALUE`;
`--sglang-server-args "..."` passes anything else verbatim. The embedded engine reads
`--sglang-max-running-requests`, `--sglang-context-length` and `--sglang-dtype` too.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.utils.arguments import add_argument_once

ROLLOUT_ENGINES = ("auto", "embedded", "sglang")
# --sglang-<name>: (type, help). Values are forwarded as --<name> to sglang.launch_server.
SGLANG_PASSTHROUGH: dict[str, tuple[Any, str]] = {
    "mem-fraction-static": (float, "fraction of device memory for weights + KV cache"),
    "context-length": (int, "context length (default: the model's)"),
    "dtype": (str, "weight dtype (auto, bfloat16, float16, float32)"),
    "max-running-requests": (int, "concurrent requests per engine"),
    "attention-backend": (str, "attention kernel backend (default: the accelerator's)"),
    "chunked-prefill-size": (int, "prefill chunk size in tokens"),
    "log-level": (str, "server log level"),
    "random-seed": (int, "server random seed"),
}
SGLANG_FLAGS = ("disable-cuda-graph", "enable-memory-saver", "disable-radix-cache")


_add = add_argument_once  # train.py's parser may define a shared flag (e.g. --rollout-num-gpus) first


def add_rollout_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("rollout data")
    _add(g, parser, "--prompt-data", type=str, default=None, help="JSONL file of prompts")
    _add(g, parser, "--input-key", type=str, default="prompt", help="JSONL key of the prompt (string or chat messages)")
    _add(g, parser, "--label-key", type=str, default="label", help="JSONL key of the reference answer")
    _add(g, parser, "--metadata-key", type=str, default="metadata", help="JSONL key of per-prompt metadata (optional)")
    _add(g, parser, "--apply-chat-template", action="store_true", help="wrap prompts with the tokenizer's chat template")
    _add(g, parser, "--rollout-shuffle", action="store_true", help="shuffle prompts each epoch (seeded)")
    _add(g, parser, "--rollout-seed", type=int, default=42, help="seed of prompt shuffling and of sampling")
    _add(g, parser, "--rollout-max-prompt-len", type=int, default=None, help="drop prompts longer than this (tokens)")

    g = parser.add_argument_group("rollout generation")
    _add(g, parser, "--rollout-batch-size", type=int, default=None, help="prompts per rollout")
    _add(g, parser, "--n-samples-per-prompt", type=int, default=1, help="responses per prompt (GRPO group size)")
    _add(g, parser, "--rollout-max-response-len", type=int, default=1024, help="max new tokens per response")
    _add(g, parser, "--rollout-temperature", type=float, default=1.0)
    _add(g, parser, "--rollout-top-p", type=float, default=1.0)
    _add(g, parser, "--rollout-top-k", type=int, default=-1, help="-1 = off")
    _add(g, parser, "--rollout-stop-token-ids", type=int, nargs="*", default=None, help="extra stop token ids")
    _add(g, parser, "--max-concurrency", type=int, default=64, help="max in-flight generate requests per rollout")
    _add(g, parser, "--rollout-request-timeout", type=float, default=3600.0,
         help="seconds one generate request may take before its engine is treated as hung (checked, restarted)")

    g = parser.add_argument_group("rewards")
    _add(g, parser, "--rm-type", type=str, default=None, help="built-in reward: math (exact match) or synthetic")
    _add(g, parser, "--custom-rm-path", type=str, default=None,
         help="module.fn (or module:fn) computing fn(args, sample) -> float; overrides --rm-type")

    g = parser.add_argument_group("rollout engines")
    _add(g, parser, "--rollout-engine", choices=ROLLOUT_ENGINES, default="auto",
         help="auto: SGLang where it is installed and the device is not a CPU, else the embedded engine")
    _add(g, parser, "--rollout-num-gpus", type=int, default=None, help="devices for rollout engines")
    _add(g, parser, "--rollout-num-gpus-per-engine", type=int, default=1, help="devices per engine (engine TP size)")
    _add(g, parser, "--rollout-engine-max-restarts", type=int, default=2,
         help="restarts per engine after it dies (its lost requests are re-issued)")
    _add(g, parser, "--rollout-engine-startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    for name, (typ, help_) in SGLANG_PASSTHROUGH.items():
        _add(g, parser, f"--sglang-{name}", type=typ, default=None, help=f"SGLang --{name}: {help_}")
    for name in SGLANG_FLAGS:
        _add(g, parser, f"--sglang-{name}", action="store_true", help=f"SGLang --{name}")
    _add(g, parser, "--sglang-server-args", type=str, default="", help="extra sglang.launch_server arguments, verbatim")
    g = parser.add_argument_group("rollout router")
    _add(g, parser, "--rollout-router", choices=("auto", "sglang-router", "in-process"), default="auto",
         help="auto: the sglang-router package when installed (as upstream), else in-process routing")
    _add(g, parser, "--sglang-router-ip", type=str, default=None,
         help="a running sglang-router to register the engines with (default: start one)")
    _add(g, parser, "--sglang-router-port", type=int, default=None, help="port of --sglang-router-ip")
    return parser


def rollout_defaults(**overrides: Any) -> argparse.Namespace:
    """A Namespace with every rollout flag at its default (tests, scripts), updated by `overrides`."""
    ns = add_rollout_arguments(argparse.ArgumentParser()).parse_args([])
    ns.hf_checkpoint = None
    ns.output_dir = None
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def sglang_passthrough(args: argparse.Namespace) -> list[str]:
    """sglang.launch_server arguments from the --sglang-* flags."""
    import shlex

    out: list[str] = []
    for name in SGLANG_PASSTHROUGH:
        v = getattr(args, "sglang_" + name.replace("-", "_"), None)
        if v is not None:
            out += [f"--{name}", str(v)]
    for name in SGLANG_FLAGS:
        if getattr(args, "sglang_" + name.replace("-", "_"), False):
            out.append(f"--{name}")
    out += shlex.split(getattr(args, "sglang_server_args", "") or "")
    return out


class RolloutArgumentError(ValueError):
    """A bad rollout flag. One line: the problem and the fix."""


def validate_rollout_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the rollout flags before any engine starts (raises RolloutArgumentError)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise RolloutArgumentError(msg)

    if getattr(args, "prompt_data", None):
        need(args.rollout_batch_size is not None and args.rollout_batch_size >= 1,
             "--rollout-batch-size is required (prompts per rollout, >= 1)")
        need(bool(args.rm_type or args.custom_rm_path),
             "no reward: pass --rm-type (math, synthetic) or --custom-rm-path module.fn")
    need(args.n_samples_per_prompt >= 1, f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    need(args.rollout_max_response_len >= 1,
         f"--rollout-max-response-len must be >= 1, got {args.rollout_max_response_len}")
    need(args.rollout_temperature >= 0, f"--rollout-temperature must be >= 0, got {args.rollout_temperature}")
    need(0 < args.rollout_top_p <= 1, f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
    need(args.rollout_top_k == -1 or args.rollout_top_k >= 1, f"--rollout-top-k must be -1 or >= 1, got {args.rollout_top_k}")
    need(args.max_concurrency >= 1, f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    need(args.rollout_engine_max_restarts >= 0, "--rollout-engine-max-restarts must be >= 0")
    return args
