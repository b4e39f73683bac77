"""Rollout, data and engine flags (slime's names) and their validation. `add_rollout_arguments(parser)` is
included by train.py's parser; the rollout code reads only an argparse Namespace. `slime.config.rollout_args`
is the public face of this module (with `rollout_defaults`, which needs the whole parser).

`--sglang-<flag> VALUE` options are passed to `sglang.launch_server` as `--<flag> VALUE`: the ones
below are typed here, every other SGLang server option (and every sglang-router option as `--router-*`)
is registered from SGLang's own surface by `slime.config.sglang_options`, typed as SGLang types it;
`--sglang-server-args "..."` passes anything verbatim. The embedded engine reads
`--sglang-max-running-requests`, `--sglang-context-length` and `--sglang-dtype` too.
"""

from __future__ import annotations

import argparse
import json

from slime.config.parser_helpers import add_argument_once
from slime.config.sglang_options import SGLANG_FLAGS, SGLANG_PASSTHROUGH  # noqa: F401 (also this module's API)
from slime.rollout.settings import eval_datasets, request_concurrency  # noqa: F401 (also this module's API)

ROLLOUT_ENGINES = ("auto", "embedded", "sglang")


_add = add_argument_once  # train.py's parser may define a shared flag (e.g. --rollout-num-gpus) first


def add_rollout_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_data_arguments(parser)
    _add_generation_arguments(parser)
    _add_plugin_arguments(parser)
    _add_reward_and_network_arguments(parser)
    _add_engine_arguments(parser)
    _add_router_arguments(parser)
    from slime.config.sglang_options import add_router_options, add_server_options

    add_server_options(parser)  # every other --sglang-<option>, typed as SGLang types it
    add_router_options(parser)  # --router-<option>, upstream slime's defaults
    _add_eval_arguments(parser)
    return parser


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout data")
    _add(g, parser, "--prompt-data", type=str, default=None,
         help="prompts: a .jsonl or .parquet file (PATH@[start:end] takes those rows)")
    _add(g, parser, "--input-key", type=str, default="prompt", help="JSONL key of the prompt (string or chat messages)")
    _add(g, parser, "--label-key", type=str, default="label", help="JSONL key of the reference answer")
    _add(g, parser, "--metadata-key", type=str, default="metadata", help="JSONL key of per-prompt metadata (optional)")
    _add(g, parser, "--tool-key", type=str, default="tools",
         help="key of a prompt's tool list (a JSON list or its text), passed to the chat template as tools=")
    _add(g, parser, "--rollout-data-transport", choices=("object-store",), default="object-store",
         help="how rollout data reaches the trainer: Ray's object store (upstream's default)")
    _add(g, parser, "--apply-chat-template", action="store_true", help="wrap prompts with the tokenizer's chat template")
    _add(g, parser, "--apply-chat-template-kwargs", type=json.loads, default="{}",
         help='JSON object of extra chat-template arguments, e.g. \'{"enable_thinking": false}\'')
    _add(g, parser, "--rollout-shuffle", action="store_true", help="shuffle prompts each epoch (seeded)")
    _add(g, parser, "--rollout-seed", type=int, default=42, help="seed of prompt shuffling and of sampling")
    _add(g, parser, "--rollout-max-prompt-len", type=int, default=None, help="drop prompts longer than this (tokens)")
    _add(g, parser, "--rollout-max-context-len", type=int, default=None,
         help="context size of a rollout (prompt + response tokens); --rollout-max-prompt-len defaults to it - 1 "
              "(at most the model's max_position_embeddings)")
    _add(g, parser, "--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset",
         help="read no --prompt-data: the --rollout-function-path manages its data (the data source gives it "
              "groups of empty Samples; nothing of it is saved with checkpoints)")
    _add(g, parser, "--start-rollout-id", type=int, default=None,
         help="first rollout id (default: the one after the checkpoint --load resumes, else 0)")


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
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

    _add(g, parser, "--over-sampling-batch-size", type=int, default=None,
         help="prompt groups submitted at a time (default: rollout-batch-size), again whenever fewer than "
              "--rollout-batch-size are pending; the first --rollout-batch-size groups to finish (and pass the "
              "filter) are kept, the rest aborted")
    _add(g, parser, "--dynamic-sampling-filter-path", type=str, default=None,
         help="module.fn(args, samples_of_one_prompt) -> DynamicFilterOutput (or a bool): keep the group? e.g. "
              "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
    _add(g, parser, "--custom-generate-function-path", type=str, default=None,
         help="async module.fn(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample] replacing the "
              "single-turn /generate call (upstream's contract; runs through slime.rollout.sglang_rollout)")


def _add_reward_and_network_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rewards")
    _add(g, parser, "--rm-type", type=str, default=None,
         help="built-in reward: deepscaler, dapo, math, f1, gpqa, remote_rm, random or synthetic (prefix boxed_ "
              "to grade the last \\boxed{} only); see slime/rollout/rm_hub/__init__.py")
    _add(g, parser, "--custom-rm-path", type=str, default=None,
         help="module.fn (or module:fn): async fn(args, sample, **kwargs) -> number or dict (plain functions "
              "too; with --group-rm fn(args, samples) -> list); overrides --rm-type")
    _add(g, parser, "--reward-key", type=str, default=None,
         help="the reward function returns a dict: train on this key (e.g. --rm-type dapo --reward-key score)")
    _add(g, parser, "--eval-reward-key", type=str, default=None, help="the same for evaluation (default: --reward-key)")
    _add(g, parser, "--group-rm", action="store_true",
         help="score a prompt's samples with one call (rm_hub.batched_async_rm; the custom reward gets the list)")
    _add(g, parser, "--rm-url", type=str, default=None,
         help="reward service for --rm-type remote_rm: POST {prompt, response, label} -> reward (JSON)")

    g = parser.add_argument_group("network", "upstream's HTTP client options (slime.utils.http_utils)")
    _add(g, parser, "--http-proxy", type=str, default=None,
         help="http://HOST:PORT: an HTTP proxy for requests to servers other than the run's router and engines "
              "(--rm-url rewards, plugins' posts)")
    _add(g, parser, "--use-distributed-post", action="store_true",
         help="http_utils.post requests are sent by Ray actors, --actor-num-gpus-per-node on every alive node, in "
              "turn (one that fails is sent from the rollout manager)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
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
    _add(g, parser, "--sglang-server-concurrency", type=int, default=512,
         help="client-side limit of concurrent generate requests per engine (upstream's; not an SGLang option): "
              "at most this x engines samples in flight, within --max-concurrency")
    _add(g, parser, "--sglang-config", type=str, default=None,
         help="YAML of SGLang server groups (upstream's format: sglang: [{name, server_groups: [{worker_type, "
              "num_gpus, num_gpus_per_engine, overrides}]}]); read and checked before Ray starts")
    parser.set_defaults(sglang_deployments=None, sglang_launch_args=None,  # filled by validation
                        router_launch_args=None, rollout_engine_kind=None)
    _add(g, parser, "--prefill-num-servers", type=int, default=None,
         help="PD disaggregation: engines that only prefill (the rest decode); exclusive with --sglang-config")


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout router")
    _add(g, parser, "--rollout-router", choices=("auto", "sglang-router", "in-process"), default="auto",
         help="auto: the sglang-router package when installed (as upstream), else in-process routing")
    _add(g, parser, "--sglang-router-ip", type=str, default=None,
         help="a running sglang-router to register the engines with (default: start one)")
    _add(g, parser, "--sglang-router-port", type=int, default=None, help="port of --sglang-router-ip")
    _add(g, parser, "--sglang-router-request-timeout-secs", type=int, default=14400,
         help="seconds the router lets one request take (its --request-timeout-secs)")


def _add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream slime's rollout hooks (docs/plugins.md has every signature)."""
    g = parser.add_argument_group("rollout plugins", "upstream slime's customization hooks (docs/plugins.md)")
    _add(g, parser, "--rollout-function-path", type=str, default=None,
         help="fn(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | list[list[Sample]] "
              "(upstream's is slime.rollout.sglang_rollout.generate_rollout); default: this project's loop")
    _add(g, parser, "--eval-function-path", type=str, default=None,
         help="the rollout function for evaluation, called with evaluation=True -> RolloutFnEvalOutput "
              "(default: --rollout-function-path)")
    _add(g, parser, "--data-source-path", type=str, default=None,
         help="a class built as cls(args) with get_samples(n) -> list[list[Sample]], add_samples, save, load, "
              "__len__ (default: slime.rollout.data_source.RolloutDataSourceWithBuffer over --prompt-data)")
    _add(g, parser, "--buffer-filter-path", type=str, default=None,
         help="fn(args, rollout_id, buffer, num_samples) -> groups taken from the data source's buffer")
    _add(g, parser, "--rollout-sample-hook-path", action="append", default=[],
         help="(repeatable) hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None, sync or async: "
              "applied in order to every generated sample (training and evaluation, both rollout paths) before its "
              "reward; a returned Sample replaces it")
    _add(g, parser, "--rollout-sample-filter-path", type=str, default=None,
         help="fn(args, groups) -> None after the rollout; a sample it marks remove_sample=True gets no loss")
    _add(g, parser, "--rollout-all-samples-process-path", type=str, default=None,
         help="fn(args, all_groups, data_source) -> None: every generated group, dropped ones included")
    _add(g, parser, "--rollout-stop", type=str, nargs="+", default=None, help="stop strings of generation")
    _add(g, parser, "--rollout-skip-special-tokens", action="store_true",
         help="the engine decodes the response text without special tokens")
    _add(g, parser, "--custom-config-path", type=str, default=None,
         help="YAML mapping of extra attributes set on args before the checks (upstream's; plugins read them)")
    _add(g, parser, "--custom-reward-post-process-path", type=str, default=None,
         help="fn(args, samples) -> (raw_rewards, rewards): the rewards the trainer uses as they are (no group "
              "normalization of its own)")
    _add(g, parser, "--custom-convert-samples-to-train-data-path", type=str, default=None,
         help="fn(args, samples) -> dict (tokens, response_lengths, rewards, loss_masks, [rollout_log_probs]): "
              "the training data instead of the built-in conversion; its rewards are used as they are")
    _add(g, parser, "--custom-rollout-log-function-path", type=str, default=None,
         help="fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool: called after each "
              "rollout; True skips the built-in rollout/perf metrics")
    _add(g, parser, "--custom-eval-rollout-log-function-path", type=str, default=None,
         help="fn(rollout_id, args, data, extra_metrics) -> bool: called after each plugin evaluation "
              "({set: {rewards, truncated, samples}}); True skips the built-in eval metrics")
    _add(g, parser, "--partial-rollout", action="store_true",
         help="groups still generating when the batch is full are aborted with their tokens so far and go back to "
              "the data source; a later rollout continues them")
    _add(g, parser, "--mask-offpolicy-in-partial-rollout", action="store_true",
         help="with --partial-rollout: the part generated by older weights gets loss mask 0")


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation", "generate on held-out prompts before training and every "
                                  "--eval-interval rollouts; metrics go to metrics.jsonl (kind: eval) and the report")
    _add(g, parser, "--eval-interval", type=int, default=None, help="evaluate every N rollouts (and before the first)")
    _add(g, parser, "--eval-prompt-data", type=str, nargs="+", default=None,
         help="NAME PATH [NAME PATH ...]: JSONL eval sets (a single PATH is named 'eval')")
    _add(g, parser, "--skip-eval-before-train", action="store_true", help="no evaluation before the first rollout")
    _add(g, parser, "--eval-input-key", type=str, default=None, help="default: --input-key")
    _add(g, parser, "--eval-label-key", type=str, default=None, help="default: --label-key")
    _add(g, parser, "--n-samples-per-eval-prompt", type=int, default=1)
    _add(g, parser, "--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    _add(g, parser, "--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    _add(g, parser, "--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    _add(g, parser, "--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len")
    _add(g, parser, "--eval-max-prompt-len", type=int, default=None, help="default: --rollout-max-prompt-len")
    _add(g, parser, "--eval-max-context-len", type=int, default=None,
         help="eval context size, --eval-max-prompt-len then at most it - 1 (default: --rollout-max-context-len)")
    _add(g, parser, "--eval-tool-key", type=str, default=None, help="default: --tool-key")
    _add(g, parser, "--eval-min-new-tokens", type=int, default=None,
         help="eval sampling's min_new_tokens: no stop (EOS, stop token or string) before this many tokens")
    _add(g, parser, "--eval-config", type=str, default=None,
         help="YAML/JSON of eval sets with their own settings (upstream's: eval: {defaults: {...}, datasets: "
              "[{name, path, n_samples_per_eval_prompt, temperature, max_response_len, rm_type, ...}]}); "
              "replaces --eval-prompt-data (docs/rollout.md)")
    parser.set_defaults(eval_datasets=None)  # filled from --eval-config by validation


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
    from slime.config.sglang_options import server_option_tokens

    out += server_option_tokens(args, skip=SGLANG_FLAGS + tuple(SGLANG_PASSTHROUGH))
    out += shlex.split(args.sglang_server_args or "")
    if args.use_rollout_routing_replay:  # SGLang records the routers' choices only when told
        out.append("--enable-return-routed-experts")
    return out


class RolloutArgumentError(ValueError):
    """A bad rollout flag. One line: the problem and the fix."""


def apply_custom_config(args: argparse.Namespace) -> None:
    """--custom-config-path: every key of the YAML mapping becomes an attribute of args (overriding a flag)."""
    import yaml

    path = args.custom_config_path
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise RolloutArgumentError(f"--custom-config-path {path!r} cannot be read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise RolloutArgumentError(f"--custom-config-path {path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(data, dict) or not all(isinstance(k, str) and k.isidentifier() for k in data):
        raise RolloutArgumentError(f"--custom-config-path {path} must hold a mapping of attribute names to values")
    for key, value in data.items():
        setattr(args, key, value)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RolloutArgumentError(msg)


def validate_rollout_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the rollout flags before Ray or any engine starts (raises RolloutArgumentError)."""
    need = _need
    if args.custom_config_path:
        apply_custom_config(args)
    if not args.rollout_global_dataset:
        need(bool(args.rollout_function_path) and args.rollout_function_path != "slime.rollout.sglang_rollout."
             "generate_rollout", "--disable-rollout-global-dataset leaves the rollout without prompts; name the "
             "--rollout-function-path that manages its data (upstream's generate_rollout reads --prompt-data)")
        need(args.rollout_batch_size is not None and args.rollout_batch_size >= 1,
             "--rollout-batch-size is required (groups per rollout, >= 1)")
    if args.prompt_data:
        need(args.rollout_batch_size is not None and args.rollout_batch_size >= 1,
             "--rollout-batch-size is required (prompts per rollout, >= 1)")
        # SFT needs none; a custom generate function may set the rewards itself (upstream's coding-agent example
        # passes neither flag); a sample it leaves without one fails the rollout with the same "no reward" line
        need(bool(args.rm_type or args.custom_rm_path or args.custom_generate_function_path)
             or args.loss_type == "sft_loss",
             "no reward: pass --rm-type (e.g. deepscaler, dapo, math) or --custom-rm-path module.fn")
    need(args.n_samples_per_prompt >= 1, f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    need(args.rollout_max_response_len >= 1,
         f"--rollout-max-response-len must be >= 1, got {args.rollout_max_response_len}")
    need(args.rollout_temperature >= 0, f"--rollout-temperature must be >= 0, got {args.rollout_temperature}")
    need(0 < args.rollout_top_p <= 1, f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
    need(args.rollout_top_k == -1 or args.rollout_top_k >= 1, f"--rollout-top-k must be -1 or >= 1, got {args.rollout_top_k}")
    need(args.max_concurrency >= 1, f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    need(args.sglang_server_concurrency >= 1,
         f"--sglang-server-concurrency must be >= 1, got {args.sglang_server_concurrency}")
    need(args.rollout_engine_max_restarts >= 0, "--rollout-engine-max-restarts must be >= 0")
    if args.rm_type:
        from slime.rollout.rewards import BUILTIN

        base = args.rm_type[len("boxed_"):] if args.rm_type.startswith("boxed_") else args.rm_type
        need(base in BUILTIN or args.custom_rm_path,
             f"--rm-type {args.rm_type!r} is unknown; choose one of {', '.join(sorted(BUILTIN))} or use --custom-rm-path")
    if (args.rm_type or "").removeprefix("boxed_") == "remote_rm":
        need(bool(args.rm_url), "--rm-type remote_rm needs --rm-url http://host:port/path (the reward service)")
    _validate_function_paths(args)
    if args.over_sampling_batch_size is not None:
        need(args.over_sampling_batch_size >= 1, f"--over-sampling-batch-size must be >= 1, got {args.over_sampling_batch_size}")
        need(not args.rollout_batch_size or args.over_sampling_batch_size >= args.rollout_batch_size,  # upstream's rule
             f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
             f"{args.rollout_batch_size} (groups submitted at a time, of which the batch keeps the first to finish)")
    if not isinstance(args.apply_chat_template_kwargs, dict):
        raise RolloutArgumentError("--apply-chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    _resolve_lengths(args)
    _validate_eval_args(args, need)
    _validate_sglang_args(args, need)
    args.rollout_engine_kind = resolve_engine_kind(args.rollout_engine)  # "auto" decided once, here
    # the engines' and the router's command lines, built here for the rollout manager (it never imports config)
    from slime.config.sglang_options import router_option_tokens

    args.sglang_launch_args = sglang_passthrough(args)
    args.router_launch_args = router_option_tokens(args)
    return args


def _resolve_lengths(args: argparse.Namespace) -> None:
    """Prompt lengths from the context sizes (at least one response token), and the first rollout id."""
    need = _need
    if args.rollout_max_context_len is not None:
        need(args.rollout_max_context_len >= 2, f"--rollout-max-context-len must be >= 2, got {args.rollout_max_context_len}")
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1  # at least one response token
        need(args.rollout_max_prompt_len <= args.rollout_max_context_len - 1,
             f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no response token within "
             f"--rollout-max-context-len {args.rollout_max_context_len}; lower it below the context length")
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    if args.eval_max_context_len is not None:
        if args.eval_max_prompt_len is None:
            args.eval_max_prompt_len = args.eval_max_context_len - 1
        need(args.eval_max_prompt_len <= args.eval_max_context_len - 1,
             f"--eval-max-prompt-len {args.eval_max_prompt_len} leaves no response token within "
             f"--eval-max-context-len {args.eval_max_context_len}")
    if args.start_rollout_id is not None:
        need(0 <= args.start_rollout_id < (args.num_rollout or 1 << 62),
             f"--start-rollout-id {args.start_rollout_id} must be in [0, --num-rollout)")


def _validate_function_paths(args: argparse.Namespace) -> None:
    """Every plugin function path imports (one line naming the flag otherwise), and --http-proxy parses."""
    for flag in ("custom_rm_path", "dynamic_sampling_filter_path", "custom_generate_function_path",
                 "rollout_function_path", "data_source_path", "buffer_filter_path", "rollout_sample_filter_path",
                 "rollout_all_samples_process_path", "eval_function_path", "custom_reward_post_process_path",
                 "custom_convert_samples_to_train_data_path", "custom_rollout_log_function_path",
                 "custom_eval_rollout_log_function_path"):
        path = getattr(args, flag)
        if path:
            _check_function_path(path, flag)
    for path in args.rollout_sample_hook_path or []:
        _check_function_path(path, "rollout_sample_hook_path")
    if args.http_proxy:
        from slime.utils.http_utils import _proxy_address

        try:
            _proxy_address(args.http_proxy)
        except ValueError as e:
            raise RolloutArgumentError(str(e)) from e


def resolve_engine_kind(engine: str) -> str | None:
    """The engine --rollout-engine runs: "auto" is SGLang where the device prefers it and SGLang is installed,
    else the embedded engine; a named engine is kept (preflight and the rollout manager check it is installed).
    None only where this process has no usable accelerator, which preflight then refuses in one line."""
    if engine != "auto":
        return engine
    from slime.accelerator import get_accelerator
    from slime.accelerator.cli import setup_error
    from slime.backends.sglang.launcher import sglang_available

    try:
        preferred = get_accelerator().auto_rollout_engine()
    except Exception as e:  # noqa: BLE001 - only the device set-up errors are left to preflight's one line
        if setup_error(e) is None:
            raise
        return None
    return "sglang" if preferred == "sglang" and sglang_available() else "embedded"


def _check_function_path(path: str, dest: str) -> None:
    from slime.rollout.rewards import RewardError, load_custom

    try:
        load_custom(path, "--" + dest.replace("_", "-"))
    except RewardError as e:
        raise RolloutArgumentError(str(e)) from e


def _validate_eval_args(args: argparse.Namespace, need) -> None:
    if args.eval_min_new_tokens is not None:
        need(args.eval_min_new_tokens >= 0, f"--eval-min-new-tokens must be >= 0, got {args.eval_min_new_tokens}")
    if args.eval_config:  # upstream's: it replaces --eval-prompt-data, which becomes its NAME PATH pairs
        from slime.config.eval_config import EvalConfigError, resolve_eval_config

        try:
            args.eval_datasets = resolve_eval_config(args)
        except EvalConfigError as e:
            raise RolloutArgumentError(str(e)) from e
        args.eval_prompt_data = [x for d in args.eval_datasets for x in (d.name, d.path)]
    values = args.eval_prompt_data or []
    need(len(values) <= 1 or len(values) % 2 == 0,
         f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values: {' '.join(values)}")
    names = [n for n, _ in eval_datasets(args)]
    need(len(set(names)) == len(names), f"--eval-prompt-data names must be distinct, got {names}")
    if args.eval_interval is not None:
        need(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")
        need(bool(values), "--eval-interval needs --eval-prompt-data NAME PATH (the prompts to evaluate on)")
    need(args.n_samples_per_eval_prompt >= 1, f"--n-samples-per-eval-prompt must be >= 1, got {args.n_samples_per_eval_prompt}")
    if args.eval_top_p is not None:
        need(0 < args.eval_top_p <= 1, f"--eval-top-p must be in (0, 1], got {args.eval_top_p}")
    if args.eval_temperature is not None:
        need(args.eval_temperature >= 0, f"--eval-temperature must be >= 0, got {args.eval_temperature}")
    if args.eval_max_response_len is not None:
        need(args.eval_max_response_len >= 1, f"--eval-max-response-len must be >= 1, got {args.eval_max_response_len}")


def _validate_sglang_args(args: argparse.Namespace, need) -> None:
    need(not (args.sglang_config and args.prefill_num_servers),
         "--sglang-config and --prefill-num-servers both set PD groups; use the server_groups of --sglang-config only")
    if args.prefill_num_servers is not None:
        need(args.prefill_num_servers >= 1, f"--prefill-num-servers must be >= 1, got {args.prefill_num_servers}")
    if args.sglang_config:
        from slime.config.sglang_args import SGLangConfigError, load_sglang_config

        try:
            models = load_sglang_config(args.sglang_config, args.rollout_num_gpus_per_engine)
        except SGLangConfigError as e:
            raise RolloutArgumentError(str(e)) from e
        total = sum(m.num_gpus for m in models)
        rollout_gpus = args.rollout_num_gpus
        need(rollout_gpus is None or total == rollout_gpus,
             f"--sglang-config {args.sglang_config}: its server groups use {total} devices but --rollout-num-gpus is "
             f"{rollout_gpus}; make them agree")
        args.sglang_deployments = models

