"""`--sglang-*` options: any SGLang server option, passed to `sglang.launch_server` as `--<name>`.

Upstream slime derives its `--sglang-*` flags from SGLang's `ServerArgs`; so does this module where
SGLang is installed (names are then checked against ServerArgs and typed like it). Without SGLang
(CPU machines, the embedded engine) any `--sglang-<name>` is accepted: `--sglang-<name> VALUE`, or
a switch when no value follows. `register_sglang_options(parser, argv)` adds the ones `argv` uses
to the parser before it parses, so `args.sglang_<name>` exists like any other flag and
`args.sglang_extra_options` lists them.

The embedded engine honors the options in `EMBEDDED_HONORED`; `embedded_ignored_line(args)` names
the others in one line. `--sglang-config FILE` (YAML server groups, upstream's format) is read and
checked by `load_sglang_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Sequence

# slime sets these itself for every engine (model, ports, devices); upstream skips them too
RESERVED = ("model-path", "config", "port", "host", "tp-size", "nnodes", "node-rank", "dist-init-addr",
            "base-gpu-id", "gpu-id-step", "nccl-port", "trust-remote-code", "skip-server-warmup")
# options the embedded engine reads (slime/ray/rollout_manager.py)
EMBEDDED_HONORED = ("max-running-requests", "context-length", "dtype", "random-seed")
WORKER_TYPES = ("regular", "prefill", "decode", "placeholder", "encoder")


class SGLangConfigError(ValueError):
    """A bad --sglang-config file or --sglang-* option. One line: the problem and the fix."""


def server_args_fields() -> dict[str, Any] | None:
    """SGLang's ServerArgs fields {name-with-dashes: default}, or None when SGLang is not installed."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # not installed, or its import needs a GPU stack
        return None
    return {f.name.replace("_", "-"): f.default for f in dataclasses.fields(ServerArgs)}


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0][len("--sglang-"):]


def register_sglang_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Add every `--sglang-<name>` in argv that the parser does not define yet; returns their names."""
    fields = server_args_fields()
    added: list[str] = []
    for i, token in enumerate(argv):
        if not token.startswith("--sglang-"):
            continue
        flag = token.split("=", 1)[0]
        name = _flag_name(token)
        if flag in parser._option_string_actions or name in added:
            continue
        if name in RESERVED:
            raise SGLangConfigError(f"{flag}: slime sets SGLang's --{name} itself for every engine; remove it")
        if fields is not None and name not in fields:
            raise SGLangConfigError(f"{flag}: SGLang's ServerArgs has no option --{name}; check the name "
                                    "(python -m sglang.launch_server --help)")
        has_value = "=" in token or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))
        default = None if fields is None else fields[name]
        if has_value:
            typ = type(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else str
            parser.add_argument(flag, type=typ, default=None, help=argparse.SUPPRESS)
        else:
            if fields is not None and not isinstance(default, bool):
                raise SGLangConfigError(f"{flag} needs a value (SGLang's --{name} is not a switch)")
            parser.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        added.append(name)
    return added


def extra_options(args: argparse.Namespace) -> dict[str, Any]:
    """{sglang option name: value} of the options register_sglang_options added and argv set."""
    out = {}
    for name in args.sglang_extra_options:
        value = getattr(args, "sglang_" + name.replace("-", "_"), None)
        if value is not None:
            out[name] = value
    return out


def embedded_ignored_line(args: argparse.Namespace) -> str | None:
    """One line naming the --sglang-* options the embedded engine ignores, or None."""
    from slime.config.rollout_args import SGLANG_FLAGS, SGLANG_PASSTHROUGH

    given = [n for n in SGLANG_PASSTHROUGH if getattr(args, "sglang_" + n.replace("-", "_"), None) is not None]
    given += [n for n in SGLANG_FLAGS if getattr(args, "sglang_" + n.replace("-", "_"), False)]
    given += list(extra_options(args))
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
            for key in overrides:
                name = str(key).replace("_", "-")
                if not str(key).replace("_", "").isalnum():
                    raise bad(f"{where}: override {key!r} is not an option name")
                if fields is not None and name not in fields:
                    raise bad(f"{where}: override {key!r} is not an SGLang ServerArgs field")
            groups.append(ServerGroup(wt, n, per, dict(overrides)))
        if {g.worker_type for g in groups} & {"prefill", "decode"} and not (
                {"prefill", "decode"} <= {g.worker_type for g in groups}):
            raise bad(f"model {m['name']!r}: PD disaggregation needs both a prefill and a decode group")
        models.append(ModelDeployment(m["name"], m.get("model_path"), m.get("update_weights"), tuple(groups)))
    return models
