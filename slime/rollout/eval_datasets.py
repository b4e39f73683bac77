"""Evaluation sets with their own settings: upstream slime's per-dataset eval configuration.

A set comes from `--eval-prompt-data NAME PATH` (every setting from the eval flags) or from an entry of
`--eval-config` (slime.config.eval_config reads the YAML). Each setting is, in this order: the entry's own
value, the config's `eval.defaults`, then the flags (upstream's order):

    n_samples_per_eval_prompt  --n-samples-per-eval-prompt      temperature  --eval-temperature, --rollout-temperature
    top_p      --eval-top-p, --rollout-top-p                    top_k        --eval-top-k, --rollout-top-k
    max_response_len  --eval-max-response-len, --rollout-max-response-len
    min_new_tokens  --eval-min-new-tokens                       stop / stop_token_ids  --rollout-stop(-token-ids)
    input_key / label_key / tool_key  --eval-*-key, --*-key     metadata_key  --metadata-key
    apply_chat_template(_kwargs)  the same flags                custom_rm_path  --custom-rm-path
and, with no flag behind them: rm_type (written into each sample's metadata, which the reward reads),
metadata_overrides (merged into each sample's metadata), repetition_penalty, skip_special_tokens (default
--rollout-skip-special-tokens), no_stop_trim (default true), custom_generate_function_path (the set's
generate function).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from slime.rollout.settings import eval_datasets as eval_prompt_pairs

# setting -> the flags it falls back to, first set wins (upstream's DATASET_*_SPECS)
FLAG_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("custom_rm_path",),
}


@dataclass
class EvalDataset:
    name: str
    path: str
    n_samples_per_eval_prompt: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict = field(default_factory=dict)

    def metadata(self, sample_metadata: Any) -> dict:
        """A sample's metadata with the set's rm_type and metadata_overrides written in (upstream's inject_metadata)."""
        out = dict(sample_metadata) if isinstance(sample_metadata, dict) else {}
        if self.rm_type is not None:
            out["rm_type"] = self.rm_type
        out.update(self.metadata_overrides)
        return out

    def prepare(self, sample: Any) -> None:
        """What a sample of this set carries for its generate function and reward."""
        sample.metadata = self.metadata(sample.metadata)
        sample.custom_rm_path = self.custom_rm_path
        sample.generate_function_path = self.custom_generate_function_path

    def sampling_params(self, args: Any) -> dict[str, Any]:
        """The set's SGLang sampling params (without the per-sample seed)."""
        params: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "max_new_tokens": self.max_response_len, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": bool(args.rollout_skip_special_tokens if self.skip_special_tokens is None
                                        else self.skip_special_tokens),
            "no_stop_trim": True if self.no_stop_trim is None else bool(self.no_stop_trim),
            "min_new_tokens": self.min_new_tokens, "repetition_penalty": self.repetition_penalty,
        }
        return {k: v for k, v in params.items() if v is not None}

    def rollout_args(self, args: Any) -> Any:
        """A copy of args whose rollout sampling flags carry this set's values (the built-in loop reads those)."""
        out = copy.copy(args)
        out.rollout_temperature, out.rollout_top_p = self.temperature, self.top_p
        out.rollout_top_k, out.rollout_max_response_len = self.top_k, self.max_response_len
        out.rollout_stop, out.rollout_stop_token_ids = self.stop, self.stop_token_ids
        if self.skip_special_tokens is not None:
            out.rollout_skip_special_tokens = bool(self.skip_special_tokens)
        out.custom_generate_function_path = self.custom_generate_function_path or args.custom_generate_function_path
        out.reward_key = args.eval_reward_key or args.reward_key
        return out

    def extra_sampling_params(self) -> dict[str, Any]:
        """What the built-in loop's sampling_params has no flag for."""
        extra = {"min_new_tokens": self.min_new_tokens, "repetition_penalty": self.repetition_penalty}
        if self.no_stop_trim is not None:
            extra["no_stop_trim"] = bool(self.no_stop_trim)
        return {k: v for k, v in extra.items() if v is not None}

    def overrides_reward(self, args: Any) -> bool:
        return self.rm_type is not None or self.custom_rm_path != args.custom_rm_path


SETTINGS = tuple(f.name for f in fields(EvalDataset) if f.name not in ("name", "path"))


def resolve_eval_dataset(args: Any, entry: dict[str, Any], defaults: dict[str, Any] | None = None) -> EvalDataset:
    """One set from its config entry (name, path, settings), the config's defaults and the flags."""
    defaults = defaults or {}
    values: dict[str, Any] = {"name": str(entry["name"]), "path": str(entry["path"])}
    for key in SETTINGS:
        value = entry.get(key)
        if value is None:
            value = defaults.get(key)
        if value is None:
            value = next((getattr(args, flag) for flag in FLAG_FALLBACKS.get(key, ())
                          if getattr(args, flag) is not None), None)
        if value is not None:
            values[key] = copy.deepcopy(value)
    return EvalDataset(**values)


def eval_dataset_list(args: Any) -> list[EvalDataset]:
    """The run's eval sets: --eval-config's (resolved when the flags were checked), else --eval-prompt-data's."""
    if args.eval_datasets is not None:
        return list(args.eval_datasets)
    return [resolve_eval_dataset(args, {"name": name, "path": path}) for name, path in eval_prompt_pairs(args)]
