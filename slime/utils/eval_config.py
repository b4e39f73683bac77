"""Upstream slime's `slime.utils.eval_config`: per-dataset evaluation settings as upstream's plugins build them
(`EvalDatasetConfig`, `build_eval_dataset_configs`, `ensure_dataset_list`, `pick_from_args`).

Settings resolve as upstream resolves them: a key present in the dataset entry wins (even when its value is
None), then a key present in the defaults, then the first flag in slime.rollout.eval_datasets' fallback table
that is set. `EvalDatasetConfig.to_eval_dataset()` gives the project's EvalDataset, which the built-in
evaluation runs; the keys the project does not build (slime.config.eval_config.REFUSED_KEYS) are kept as data
here and refused there."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from slime.rollout.eval_datasets import FLAG_FALLBACKS, SETTINGS, EvalDataset

# setting -> flags, first set wins: the project's table plus upstream's entries that it has no flag behind
# (multimodal_keys, min_eval_samples) and upstream's --eval-custom-rm-path ahead of --custom-rm-path
UPSTREAM_FLAG_FALLBACKS: dict[str, tuple[str, ...]] = {
    **FLAG_FALLBACKS,
    "custom_rm_path": ("eval_custom_rm_path", "custom_rm_path"),
    "multimodal_keys": ("multimodal_keys",),
    "min_eval_samples": (),
}


def pick_from_args(args: Any, attrs: tuple[str, ...]) -> Any:
    """The first of `attrs` that `args` has and is not None; None when none is."""
    for attr in attrs:
        try:
            value = getattr(args, attr)
        except AttributeError:  # a plugin's namespace may lack flags this project or upstream defines
            continue
        if value is not None:
            return value
    return None


@dataclass
class EvalDatasetConfig:
    """One evaluation dataset: its name, path and upstream's per-dataset settings (None: not set)."""

    name: str
    path: str
    rm_type: str | None = None
    custom_rm_path: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    multimodal_keys: dict[str, str] | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict[str, Any] | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_generate_function_path: str | None = None
    app_service: str | None = None
    eval_task_timeout: int | None = None
    min_eval_samples: int | None = None
    eval_early_stop_remaining: int | None = None
    eval_early_stop_idle_timeout: float | None = None
    message_processor: dict[str, Any] | None = None
    reward_model: dict[str, Any] | None = None
    remote_environment: dict[str, Any] | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metadata_overrides is None:
            self.metadata_overrides = {}
        if not isinstance(self.metadata_overrides, dict):
            raise TypeError(f"eval dataset {self.name!r}: metadata_overrides must be a mapping, "
                            f"got {type(self.metadata_overrides).__name__}")
        if self.min_eval_samples is not None and self.min_eval_samples <= 0:
            raise ValueError(f"eval dataset {self.name!r}: min_eval_samples must be positive when set, "
                             f"got {self.min_eval_samples}")

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """What identifies the dataset's loaded prompts: its name, path and the keys read from each row."""
        return (self.name, self.path, self.input_key, self.label_key, self.tool_key, self.metadata_key)

    def to_eval_dataset(self) -> EvalDataset:
        """The project's EvalDataset with this config's settings (unset ones left to EvalDataset's defaults)."""
        values = {key: getattr(self, key) for key in SETTINGS if getattr(self, key) is not None}
        return EvalDataset(name=self.name, path=self.path, **values)

    def inject_metadata(self, sample_metadata: Any) -> dict[str, Any]:
        """A copy of a sample's metadata (a non-mapping counts as empty) with rm_type and metadata_overrides."""
        return EvalDataset(self.name, self.path, rm_type=self.rm_type,
                           metadata_overrides=self.metadata_overrides).metadata(sample_metadata)


def ensure_dataset_list(config: Any) -> list[dict[str, Any]]:
    """eval.datasets as a list of entry dicts: a mapping name -> entry (the key is the entry's default name)
    or a list of entries that each name themselves; None is no dataset."""
    if config is None:
        return []
    if isinstance(config, dict):
        return [{"name": name, **dict(entry or {})} for name, entry in config.items()]
    if isinstance(config, (list, tuple)):
        entries = [dict(entry or {}) for entry in config]
        for entry in entries:
            if "name" not in entry:
                raise ValueError("Each evaluation dataset entry must include a `name` field "
                                 f"(entry {entry} has none)")
        return entries
    raise TypeError(f"eval.datasets must be either a list or a mapping, got {type(config).__name__}")


def _check_default_keys(defaults: dict[str, Any]) -> None:
    valid = {f.name for f in fields(EvalDatasetConfig)} | set(UPSTREAM_FLAG_FALLBACKS)
    unknown = set(defaults) - valid
    if unknown:
        raise ValueError(f"Unknown key(s) in eval.defaults: {sorted(unknown)}; valid keys: {sorted(valid)}")


def build_eval_dataset_configs(args: Any, raw_config: Iterable[dict[str, Any]], defaults: dict[str, Any]
                               ) -> list[EvalDatasetConfig]:
    """One EvalDatasetConfig per entry: each setting from the entry, else eval.defaults, else the flags."""
    defaults = defaults or {}
    _check_default_keys(defaults)
    configs = []
    for entry in raw_config:
        values = dict(entry or {})
        for key, flags in UPSTREAM_FLAG_FALLBACKS.items():
            if key not in values:
                values[key] = defaults[key] if key in defaults else pick_from_args(args, flags)
        for key, value in defaults.items():  # settings with no flag behind them still take the defaults
            values.setdefault(key, value)
        configs.append(EvalDatasetConfig(**values))
    return configs
