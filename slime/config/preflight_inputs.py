"""Preflight checks of inputs that used to fail only after Ray had started (or were accepted silently);
`slime.config.preflight.run_preflight` runs them. Each failure is one `PreflightError` line (exit 2, nothing
written); an accepted combination that likely does not do what was meant adds one warning line.

- the accelerator (SLIME_ACCELERATOR or detected) can start here;
- --rollout-engine sglang: SGLang and the triton its server imports are installed;
- --num-cpus >= 1; on CPU, more trainer ranks than cores is a warning;
- --eval-prompt-data NAME PATH: every set, as --prompt-data;
- --rollout-max-prompt-len: it keeps at least one prompt (tokenized with the checkpoint's tokenizer, loaded
  only when the flag is given), the dropped count is a warning;
- --use-kl-loss with --kl-loss-coef 0 (no KL term), or without --ref-load (upstream requires one): warnings;
  --max-tokens-per-gpu below one sample: a warning;
- --save / --output-dir are not the HF model directory.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

from slime.config.preflight_report import UNLABELLED_REWARDS, PreflightError, PreflightReport, _reward_base


def _rule_reward(args: Any) -> bool:
    from slime.rollout.rewards import BUILTIN

    base = _reward_base(args.rm_type)
    return not args.custom_rm_path and base in BUILTIN and base not in UNLABELLED_REWARDS


def check_accelerator(args: Any):
    """The accelerator of this run; an unmet device request (SLIME_ACCELERATOR=cuda on a CPU build) is one line."""
    from slime.accelerator import get_accelerator
    from slime.accelerator.cli import setup_error

    try:
        return get_accelerator()
    except Exception as e:  # noqa: BLE001 - only the set-up errors become one line
        if setup_error(e) is None:
            raise
        text = str(e).strip().splitlines()
        raise PreflightError(text[0] if text else type(e).__name__) from e


def check_rollout_engine(args: Any, acc: Any) -> None:
    if args.rollout_engine != "sglang":
        return
    if importlib.util.find_spec("sglang") is None:
        raise PreflightError("--rollout-engine sglang: SGLang is not installed; install it (docs/rollout.md) or use "
                             "--rollout-engine embedded")
    if importlib.util.find_spec("triton") is None:
        raise PreflightError(f"--rollout-engine sglang: SGLang's server imports triton, which is not installed on this "
                             f"{acc.name} machine; use --rollout-engine embedded (or auto, which picks it here)")


def check_resources(args: Any, acc: Any, report: PreflightReport) -> None:
    num_cpus = args.num_cpus
    if num_cpus is not None and num_cpus < 1:
        raise PreflightError(f"--num-cpus {num_cpus}: Ray could place no trainer rank or engine; pass at least 1, or "
                             "leave it out for all cores")
    cores = num_cpus or os.cpu_count() or 1
    world = args.world_size  # validation set it
    if acc.ray_resource is None and world > cores:  # ranks are CPU bundles: they share the host's cores
        report.warnings.append(f"{world} trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node) on {cores} CPU "
                               f"cores: on CPU each rank is a worker slot and they share the cores (slow); use at "
                               f"most {cores}")


def check_eval_prompts(args: Any) -> None:
    """Every --eval-prompt-data NAME PATH set: readable, each record with the eval input key (and label, for a
    rule reward)."""
    from slime.rollout.settings import eval_datasets
    from slime.rollout.prompt_files import PromptFileError, read_records

    flag_keys = (args.eval_input_key or args.input_key,
                 args.eval_label_key or args.label_key)
    rule_reward = _rule_reward(args)
    keys = {d.name: (d.input_key, d.label_key) for d in args.eval_datasets or []}  # --eval-config
    for name, path in eval_datasets(args):
        flag = f"--eval-prompt-data {name}"
        input_key, label_key = keys.get(name, flag_keys)
        count = 0
        try:
            for where, rec in read_records(path, flag):
                if not isinstance(rec, dict) or input_key not in rec:
                    raise PreflightError(f"{flag}: {where} has no key {input_key!r}; set --eval-input-key to the "
                                         "prompt's key")
                if rule_reward and rec.get(label_key) is None:
                    raise PreflightError(f"{flag}: {where} has no label {label_key!r}, which --rm-type {args.rm_type} "
                                         "scores against; set --eval-label-key or add labels")
                count += 1
        except PromptFileError as e:
            raise PreflightError(str(e)) from e
        if not count:
            raise PreflightError(f"{flag} {path} holds no prompts; pass a JSONL file with one object per line")


def check_prompt_lengths(args: Any, report: PreflightReport) -> None:
    """--rollout-max-prompt-len against the prompts, tokenized as the rollout does."""
    limit = args.rollout_max_prompt_len
    if limit < 1:
        raise PreflightError(f"--rollout-max-prompt-len must be >= 1, got {limit}")
    from transformers import AutoTokenizer

    from slime.rollout.data_source import tokenize_prompt
    from slime.rollout.prompt_files import read_records

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    except Exception as e:  # noqa: BLE001 - any loader failure is the checkpoint's tokenizer files
        raise PreflightError(f"--hf-checkpoint {args.hf_checkpoint}: its tokenizer does not load ({type(e).__name__}); "
                             "add its tokenizer.json / tokenizer_config.json") from e
    lengths = []
    for where, rec in read_records(args.prompt_data):
        try:
            lengths.append(len(tokenize_prompt(tokenizer, rec[args.input_key], args.apply_chat_template)))
        except Exception as e:  # noqa: BLE001 - e.g. chat messages without --apply-chat-template
            raise PreflightError(f"{where}: the prompt does not tokenize ({e}); fix it, or pass --apply-chat-template "
                                 "for chat messages") from e
    report.shortest_prompt = min(lengths)
    kept = sum(n <= limit for n in lengths)
    template = " with the chat template" if args.apply_chat_template else ""
    if not kept:
        raise PreflightError(f"--rollout-max-prompt-len {limit} drops every prompt of {args.prompt_data} (the shortest "
                             f"is {min(lengths)} tokens{template}); raise it to at least {min(lengths)}")
    if kept < len(lengths):
        report.warnings.append(f"--rollout-max-prompt-len {limit} drops {len(lengths) - kept} of {len(lengths)} prompts "
                               f"(the longest is {max(lengths)} tokens{template})")


def check_training_flags(args: Any, report: PreflightReport) -> None:
    if args.use_kl_loss:
        if not args.kl_loss_coef:
            report.warnings.append("--use-kl-loss with --kl-loss-coef 0 adds no KL term and loads no reference model; "
                                   "set --kl-loss-coef > 0 (e.g. 0.01)")
        elif args.ref_load in (None, args.hf_checkpoint):
            report.warnings.append(f"--use-kl-loss without --ref-load: the reference model is --hf-checkpoint "
                                   f"{args.hf_checkpoint} (upstream slime requires --ref-load)")
    budget = args.max_tokens_per_gpu
    if args.use_dynamic_batch_size and budget:
        sample = (report.shortest_prompt or 1) + 1  # a prompt and one response token, at the least
        if budget < sample + args.rollout_max_response_len - 1:
            report.warnings.append(f"--max-tokens-per-gpu {budget} is below one sample (a {report.shortest_prompt or 'n'}-"
                                   f"token prompt + up to {args.rollout_max_response_len} response tokens): such a sample "
                                   "is a micro-batch of its own, over the budget; raise it to at least prompt + "
                                   "--rollout-max-response-len")


def check_not_model_dir(args: Any) -> None:
    """--save / --output-dir must not be the HF model directory: iter_*/, a tracker or metrics would go into it."""
    hf = args.hf_checkpoint
    for flag in ("save", "output_dir"):
        value = getattr(args, flag)
        if not value:
            continue
        name = "--" + flag.replace("_", "-")
        same = hf is not None and os.path.realpath(value) == os.path.realpath(hf)
        if same or (os.path.isfile(os.path.join(value, "config.json")) and glob.glob(os.path.join(value, "*.safetensors"))):
            what = "is the --hf-checkpoint model directory" if same else "holds an HF model (config.json + safetensors)"
            raise PreflightError(f"{name} {value} {what}; the run would write into it: pass another directory")


def check_inputs(args: Any, report: PreflightReport):
    """The checks above that need no file of the run yet (before the prompt checks); returns the accelerator."""
    acc = check_accelerator(args)
    check_rollout_engine(args, acc)
    check_resources(args, acc, report)
    check_not_model_dir(args)
    return acc


def check_data_inputs(args: Any, report: PreflightReport) -> None:
    """After --prompt-data passed its check: eval sets, prompt lengths, then the training-flag warnings."""
    if args.prompt_data and args.rollout_max_prompt_len is not None \
            and args.hf_checkpoint:
        check_prompt_lengths(args, report)
    if args.eval_prompt_data:
        check_eval_prompts(args)
    check_training_flags(args, report)
