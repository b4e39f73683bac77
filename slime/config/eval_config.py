"""`--eval-config PATH`: upstream slime's YAML (or JSON) description of the evaluation sets, read before Ray starts.

    eval:                      # (the root mapping itself may hold defaults / datasets)
      defaults: {temperature: 0.6, max_response_len: 8192}
      datasets:                # a list of entries with a name, or a mapping name -> entry
        - name: aime
          path: /data/aime.jsonl
          n_samples_per_eval_prompt: 16
          rm_type: deepscaler

It replaces --eval-prompt-data (which is rewritten to the sets' NAME PATH pairs, as upstream does). Every key
upstream's EvalDatasetConfig accepts is honored (slime.rollout.eval_datasets says how each resolves) or refused
here with one line naming it; an unknown key is refused as upstream's dataclass refuses it.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime.rollout.eval_datasets import SETTINGS, EvalDataset, resolve_eval_dataset

# keys upstream's EvalDatasetConfig accepts that nothing here builds (upstream at 624b824a8 reads none of the
# last six either): refused, so a config that relies on one does not run silently without it
REFUSED_KEYS: dict[str, str] = {
    "multimodal_keys": "multimodal (vision) prompts are not supported",
    "app_service": "generation through an external AppServer is not built",
    "eval_task_timeout": "a per-set eval timeout is not built (--rollout-request-timeout bounds each request)",
    "min_eval_samples": "a minimum count of finished eval samples is not built (every sample is generated)",
    "eval_early_stop_remaining": "early stop of an evaluation is not built",
    "eval_early_stop_idle_timeout": "early stop of an evaluation is not built",
    "message_processor": "per-source message processors are not built",
    "reward_model": "per-source reward-model configs are not built (use rm_type / custom_rm_path)",
    "remote_environment": "per-source remote environments are not built",
}
HONORED_KEYS = ("name", "path") + SETTINGS
_INT = ("n_samples_per_eval_prompt", "top_k", "max_response_len", "min_new_tokens")
_FLOAT = ("temperature", "top_p", "repetition_penalty")
_BOOL = ("skip_special_tokens", "no_stop_trim", "apply_chat_template")
_MAPPING = ("apply_chat_template_kwargs", "metadata_overrides")


class EvalConfigError(ValueError):
    """A bad --eval-config. One line: the problem and the fix."""


def read_eval_config(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(dataset entries, defaults) of the file, shape-checked."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise EvalConfigError(f"--eval-config {path!r} cannot be read ({e.strerror})") from e
    if "${" in text:
        raise EvalConfigError(f"--eval-config {path}: OmegaConf interpolation (${{...}}) is not resolved here; "
                              "write the values out")
    try:
        root = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EvalConfigError(f"--eval-config {path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(root, dict):
        raise EvalConfigError(f"--eval-config {path} must hold a mapping (eval: {{datasets: [...]}})")
    cfg = root.get("eval", root)
    if not isinstance(cfg, dict):
        raise EvalConfigError(f"--eval-config {path}: `eval` must be a mapping with `datasets` (and `defaults`)")
    defaults = cfg.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise EvalConfigError(f"--eval-config {path}: eval.defaults must be a mapping of settings")
    raw = cfg.get("datasets")
    if isinstance(raw, dict):
        entries = []
        for name, entry in raw.items():
            if entry is not None and not isinstance(entry, dict):
                raise EvalConfigError(f"--eval-config {path}: dataset {name!r} must be a mapping of settings")
            entries.append({"name": name, **(entry or {})})
    elif isinstance(raw, list):
        entries = [dict(e) if isinstance(e, dict) else e for e in raw]
        bad = [e for e in entries if not isinstance(e, dict) or "name" not in e]
        if bad:
            raise EvalConfigError(f"--eval-config {path}: every entry of eval.datasets needs a `name` (got {bad[0]!r})")
    elif raw is None:
        entries = []
    else:
        raise EvalConfigError(f"--eval-config {path}: eval.datasets must be a list or a mapping of datasets")
    if not entries:
        raise EvalConfigError(f"--eval-config {path} defines no datasets under eval.datasets")
    return entries, dict(defaults)


def _check_keys(path: str, where: str, mapping: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in mapping:
        if key in REFUSED_KEYS:
            raise EvalConfigError(f"--eval-config {path}: {where} key {key!r} is refused: {REFUSED_KEYS[key]}")
        if key not in allowed:
            raise EvalConfigError(f"--eval-config {path}: {where} has unknown key {key!r}; valid keys: "
                                  f"{', '.join(sorted(allowed))}")


def _check_values(path: str, d: EvalDataset) -> None:
    where = f"--eval-config {path}: dataset {d.name!r}"
    for key in _INT:
        v = getattr(d, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise EvalConfigError(f"{where}: {key} must be an integer, got {v!r}")
    for key in _FLOAT:
        v = getattr(d, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise EvalConfigError(f"{where}: {key} must be a number, got {v!r}")
    for key in _BOOL:
        v = getattr(d, key)
        if v is not None and not isinstance(v, bool):
            raise EvalConfigError(f"{where}: {key} must be true or false, got {v!r}")
    for key in _MAPPING:
        v = getattr(d, key)
        if v is not None and not isinstance(v, dict):
            raise EvalConfigError(f"{where}: {key} must be a mapping, got {v!r}")
    if d.n_samples_per_eval_prompt < 1:
        raise EvalConfigError(f"{where}: n_samples_per_eval_prompt must be >= 1, got {d.n_samples_per_eval_prompt}")
    if d.min_new_tokens is not None and not 0 <= d.min_new_tokens <= (d.max_response_len or d.min_new_tokens):
        raise EvalConfigError(f"{where}: min_new_tokens {d.min_new_tokens} must be in [0, max_response_len "
                              f"{d.max_response_len}]")
    if d.top_p is not None and not 0 < d.top_p <= 1:
        raise EvalConfigError(f"{where}: top_p must be in (0, 1], got {d.top_p}")
    if d.temperature is not None and d.temperature < 0:
        raise EvalConfigError(f"{where}: temperature must be >= 0, got {d.temperature}")


def resolve_eval_config(args: argparse.Namespace) -> list[EvalDataset]:
    """The sets of --eval-config, each setting resolved (entry, defaults, flags) and checked."""
    path = args.eval_config
    entries, defaults = read_eval_config(path)
    _check_keys(path, "eval.defaults", defaults, SETTINGS)
    out: list[EvalDataset] = []
    for entry in entries:
        _check_keys(path, f"dataset {entry.get('name')!r}", entry, HONORED_KEYS)
        if not entry.get("path"):
            raise EvalConfigError(f"--eval-config {path}: dataset {entry['name']!r} has no `path` (its prompts file)")
        d = resolve_eval_dataset(args, entry, defaults)
        _check_values(path, d)
        out.append(d)
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise EvalConfigError(f"--eval-config {path}: dataset names must be distinct, got {names}")
    return out
