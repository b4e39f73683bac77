"""`--sglang-*` options: any SGLang server option, passed to `sglang.launch_server` as `--<name>`.

As upstream slime, every SGLang ServerArgs option is a `--sglang-<option>` flag, typed as SGLang types it
(`slime.config.sglang_options`: read from the installed SGLang, or its recorded surface where SGLang cannot
be imported). `check_sglang_argv(parser, argv)` turns a reserved or unknown `--sglang-<name>` into one line
before argparse sees it; `extra_options(args)` lists the options given (values unlike SGLang's defaults).

The embedded engine honors the options in `EMBEDDED_HONORED`; `embedded_ignored_line(args)` names
the others in one line. `--sglang-config FILE` (YAML server groups, upstream's format) is read and
checked by `load_sglang_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Sequence

from slime.config.sglang_options import (RENAMED, RESERVED, SGLANG_FLAGS, SGLANG_PASSTHROUGH, given_server_options,
                                         server_surface)

# options the embedded engine reads (slime/ray/engine_fleet.py)
EMBEDDED_HONORED = ("max-running-requests", "context-length", "dtype", "random-seed", "enable-deterministic-inference")
WORKER_TYPES = ("regular", "prefill", "decode", "placeholder", "encoder")


class SGLangConfigError(ValueError):
    """A bad --sglang-config file or --sglang-* option. One line: the problem and the fix."""


def server_args_fields() -> set[str]:
    """SGLang's ServerArgs field names (dashes) that have a command-line option."""
    return {o.dest.replace("_", "-") for o in server_surface().options}


def check_sglang_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """One-line errors for a `--sglang-<name>` that slime sets itself or SGLang does not have; returns the
    SGLang option names argv gives."""
    names = []
    for token in argv:
        if not token.startswith("--sglang-"):
            continue
        flag = token.split("=", 1)[0]
        name = flag[len("--sglang-"):]
        if flag in parser._option_string_actions:  # slime's own, or SGLang's registered
            names.append(name)
            continue
        if name in RESERVED:
            raise SGLangConfigError(f"{flag}: slime sets SGLang's --{name} itself for every engine; remove it")
        raise SGLangConfigError(f"{flag}: SGLang {server_surface().version}'s ServerArgs has no option --{name}; "
                                "check the name (python -m sglang.launch_server --help)")
    return names


def extra_options(args: argparse.Namespace) -> dict[str, Any]:
    """{SGLang option name: value} of the SGLang options set unlike SGLang's defaults."""
    return given_server_options(args)


def embedded_ignored_line(args: argparse.Namespace) -> str | None:
    """One line naming the --sglang-* options the embedded engine ignores, or None."""
    given = [n for n in SGLANG_PASSTHROUGH if getattr(args, "sglang_" + n.replace("-", "_"), None) is not None]
    given += [n for n in SGLANG_FLAGS if getattr(args, "sglang_" + n.replace("-", "_"), False)]
    given += [n for n in extra_options(args) if n not in given]
    ignored = [f"--sglang-{n}" for n in given if n not in EMBEDDED_HONORED]
    if args.sglang_config:
        ignored.append("--sglang-config")
    if args.prefill_num_servers:
        ignored.append("--prefill-num-servers")
    if not ignored:
        return None
    return ("embedded engine: ignoring SGLang server options without meaning for it: " + ", ".join(ignored)
            + f" (it honors --sglang-{', --sglang-'.join(EMBEDDED_HONORED)})")


@dataclasses.dataclass(frozen=True)
class ServerGroup:
    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int
    overrides: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelDeployment:
    name: str
    model_path: str | None
    update_weights: bool | None
    groups: tuple[ServerGroup, ...]

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)


def load_sglang_config(path: str, default_gpus_per_engine: int) -> list[ModelDeployment]:
    """Read upstream's --sglang-config YAML: `sglang:` a list of models, each with `server_groups`
    (worker_type, num_gpus, optional num_gpus_per_engine and `overrides` of SGLang ServerArgs names)."""
    import yaml

    def bad(msg: str) -> SGLangConfigError:
        return SGLangConfigError(f"--sglang-config {path}: {msg}")

    if not os.path.isfile(path):
        raise bad("no such file; pass the YAML file of SGLang server groups")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise bad(f"not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(data, dict) or not isinstance(data.get("sglang"), list) or not data["sglang"]:
        raise bad("needs a top-level 'sglang:' list of model entries (each with name and server_groups)")
    fields = server_args_fields()
    models, names = [], set()
    for i, m in enumerate(data["sglang"]):
        if not isinstance(m, dict) or not m.get("name"):
            raise bad(f"model entry {i} needs a 'name'")
        if m["name"] in names:
            raise bad(f"model name {m['name']!r} appears twice")
        names.add(m["name"])
        unknown = set(m) - {"name", "model_path", "num_gpus_per_engine", "server_groups", "engine_groups",
                            "update_weights"}
        if unknown:
            raise bad(f"model {m['name']!r} has unknown keys {sorted(unknown)}")
        per_model = m.get("num_gpus_per_engine") or default_gpus_per_engine
        raw = m.get("server_groups") or m.get("engine_groups") or []
        if not isinstance(raw, list) or not raw:
            raise bad(f"model {m['name']!r} needs a non-empty 'server_groups' list")
        groups = []
        for j, g in enumerate(raw):
            where = f"model {m['name']!r} group {j}"
            if not isinstance(g, dict):
                raise bad(f"{where} must be a mapping")
            extra = set(g) - {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"}
            if extra:
                raise bad(f"{where} has unknown keys {sorted(extra)}")
            wt = g.get("worker_type")
            if wt not in WORKER_TYPES:
                raise bad(f"{where}: worker_type {wt!r} must be one of {', '.join(WORKER_TYPES)}")
            n, per = g.get("num_gpus"), g.get("num_gpus_per_engine") or per_model
            if not isinstance(n, int) or n < 1:
                raise bad(f"{where}: num_gpus must be a positive integer, got {n!r}")
            if not isinstance(per, int) or per < 1 or n % per:
                raise bad(f"{where}: num_gpus {n} is not a multiple of num_gpus_per_engine {per}")
            overrides = g.get("overrides") or {}
            if not isinstance(overrides, dict):
                raise bad(f"{where}: overrides must be a mapping of SGLang ServerArgs names")
            current = {}
            for key, value in overrides.items():
                name = str(key).replace("_", "-")
                if not str(key).replace("_", "").isalnum():
                    raise bad(f"{where}: override {key!r} is not an option name")
                if name not in fields and RENAMED.get(name) in fields:
                    name = RENAMED[name]  # an SGLang 0.5.7 name upstream's scripts use
                if name not in fields:
                    raise bad(f"{where}: override {key!r} is not an SGLang ServerArgs field")
                current[name.replace("-", "_")] = value
            groups.append(ServerGroup(wt, n, per, current))
        if {g.worker_type for g in groups} & {"prefill", "decode"} and not (
                {"prefill", "decode"} <= {g.worker_type for g in groups}):
            raise bad(f"model {m['name']!r}: PD disaggregation needs both a prefill and a decode group")
        models.append(ModelDeployment(m["name"], m.get("model_path"), m.get("update_weights"), tuple(groups)))
    return models
