"""SGLang's own option surface: every `sglang.launch_server` option as `--sglang-<option>`, and every
sglang-router option as `--router-<option>`, each with the type and arity SGLang gives it.

Where it comes from: the installed package's own argument registration (`ServerArgs.add_cli_args`, which
both the dataclass ServerArgs of older SGLang and the msgspec struct of 0.5.23 provide; `RouterArgs.add_cli_args`
for the router). Importing SGLang takes seconds and needs its GPU stack (triton), so the surface of the pinned
versions is also recorded in `sglang_options.json` (tests/test_sglang_options.py keeps the record equal to the
installed packages). The record is used when the installed version is the recorded one, or when SGLang is
not installed or cannot be imported (CPU machines run the embedded engine); another installed version is read
live.

Each option is registered like SGLang registers it: `nargs` lists (`--sglang-cuda-graph-bs-decode 1 2 4`),
switches, `--sglang-x/--no-sglang-x` pairs, choices, SGLang's default. Without the live package, values SGLang
parses with its own functions (e.g. `human_readable_int`) stay text; SGLang parses them when it launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from typing import Any, Callable

RECORD = os.path.join(os.path.dirname(__file__), "sglang_options.json")
# SGLang options this project sets itself for every engine (model, ports, devices), as upstream skips them
RESERVED = ("model-path", "config", "port", "host", "tp-size", "nnodes", "node-rank", "dist-init-addr",
            "base-gpu-id", "gpu-id-step", "nccl-port", "trust-remote-code", "skip-server-warmup",
            "enable-return-routed-experts")
# upstream's scripts were written against SGLang 0.5.7; options it renamed since, accepted under the old name
# where the installed SGLang lacks it (old name -> current name, same meaning)
RENAMED = {"cuda-graph-bs": "cuda-graph-bs-decode", "cuda-graph-max-bs": "cuda-graph-max-bs-decode",
           "nsa-decode-backend": "dsa-decode-backend", "nsa-prefill-backend": "dsa-prefill-backend",
           "mamba-scheduler-strategy": "mamba-radix-cache-strategy"}
# --sglang-<name>: (type, help). Values are forwarded as --<name> to sglang.launch_server.
SGLANG_PASSTHROUGH: dict[str, tuple[Any, str]] = {
    "mem-fraction-static": (float, "fraction of device memory for weights + KV cache"),
    "context-length": (int, "context length (default: the model's)"),
    "dtype": (str, "weight dtype (auto, bfloat16, float16, float32)"),
    "max-running-requests": (int, "concurrent requests per engine"),
    "chunked-prefill-size": (int, "prefill chunk size in tokens"),
    "random-seed": (int, "server random seed"),
}
SGLANG_FLAGS = ("disable-cuda-graph", "enable-memory-saver", "disable-radix-cache")
# upstream slime's router defaults (slime/backends/sglang_utils/arguments.py), not the router's own
ROUTER_DEFAULTS = {"router_balance_abs_threshold": 10, "router_balance_rel_threshold": 1.2, "router_log_level": "warn"}
ROUTER_SKIPPED = ("worker-urls",)  # the engines this project starts


def _human_readable_int(text: str) -> int:
    """SGLang's integer with an SI (k M G T, decimals allowed) or IEC (Ki Mi Gi Ti) suffix: '25.6k' -> 25600."""
    import re
    from decimal import Decimal

    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", text.strip())
    if not m:
        return int(text)
    number, suffix = m.groups()
    if suffix.endswith("i"):
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text}: no decimals with an IEC suffix ({suffix})")
        return int(number) * 2 ** (10 * "KMGT".index(suffix[0]) + 10)
    return int(Decimal(number) * 10 ** (3 * "kMGT".index(suffix) + 3))


def _nullable_str(text: str) -> str | None:
    return None if not text or text == "None" else text


# SGLang's value parsers by name, for the recorded surface (the live one uses SGLang's own); a name not
# here (e.g. parse_cuda_graph_config_arg) keeps the text, which SGLang parses when it launches
_TYPES: dict[str, Callable] = {"int": int, "float": float, "str": str, "loads": json.loads,
                               "json_list_type": json.loads, "nullable_str": _nullable_str,
                               "human_readable_int": _human_readable_int}


@dataclasses.dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]  # SGLang's spellings without "--": ("dp-size", "data-parallel-size")
    dest: str               # its ServerArgs / RouterArgs field
    kind: str               # value | store_true | store_false | bool_optional
    nargs: Any = None
    type: str | None = None  # int, float, str, or the name of SGLang's own parser function
    choices: tuple | None = None
    default: Any = None

    @property
    def name(self) -> str:
        return self.flags[0]


@dataclasses.dataclass(frozen=True)
class Surface:
    package: str
    version: str
    options: tuple[Option, ...]
    source: str  # "installed" or "record"
    types: dict = dataclasses.field(default_factory=dict, compare=False)  # live: dest -> SGLang's callable

    def by_flag(self) -> dict[str, Option]:
        return {f: o for o in self.options for f in o.flags}


def _from_actions(actions: list[argparse.Action], strip: str = "") -> tuple[list[Option], dict]:
    out, types, seen = [], {}, set()
    for a in actions:
        longs = [s[2:] for s in a.option_strings if s.startswith("--")]
        if not longs or a.dest in ("help",) or a.dest in seen:
            continue
        seen.add(a.dest)
        if isinstance(a, argparse.BooleanOptionalAction):
            kind, longs = "bool_optional", [s for s in longs if not s.startswith("no-")]
        elif a.nargs == 0:
            kind = "store_false" if a.const is False else "store_true"
        else:
            kind = "value"
        longs = [s[len(strip):] if strip and s.startswith(strip) else s for s in longs]
        typ = None if a.type is None else getattr(a.type, "__name__", str(a.type))
        default = a.default if _jsonable(a.default) else str(a.default)
        # sorted: some are built from sets (no stable order); argparse only tests membership
        choices = None if a.choices is None else tuple(sorted(a.choices, key=str))
        out.append(Option(tuple(longs), a.dest, kind, a.nargs if kind == "value" else None, typ, choices, default))
        if a.type is not None:
            types[a.dest] = a.type
    return out, types


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def installed_server_surface() -> Surface:
    """Read from the installed SGLang (raises ImportError when it cannot be imported)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    options, types = _from_actions(parser._actions)
    return Surface("sglang", _installed_version("sglang") or "?", tuple(options), "installed", types)


def installed_router_surface() -> Surface:
    from sglang_router.launch_router import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    options, types = _from_actions(parser._actions)
    return Surface("sglang-router", _installed_version("sglang-router") or "?", tuple(options), "installed", types)


def surface_to_json(surface: Surface) -> dict:
    return {"package": surface.package, "version": surface.version,
            "options": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(o).items()}
                        for o in surface.options]}


@functools.lru_cache(maxsize=None)
def _record() -> dict:
    with open(RECORD, encoding="utf-8") as f:
        return json.load(f)


def recorded_surface(package: str) -> Surface:
    data = _record()[package]
    options = tuple(Option(tuple(o["flags"]), o["dest"], o["kind"], o["nargs"], o["type"],
                           tuple(o["choices"]) if o["choices"] is not None else None, o["default"])
                    for o in data["options"])
    return Surface(package, data["version"], options, "record")


def _surface(package: str, read_installed: Callable[[], Surface]) -> Surface:
    version = _installed_version(package)
    if version is None or version == _record()[package]["version"]:
        return recorded_surface(package)
    try:
        return read_installed()
    except Exception:  # noqa: BLE001 - e.g. SGLang's import needs triton, absent on CPU machines
        return recorded_surface(package)


@functools.lru_cache(maxsize=None)
def server_surface() -> Surface:
    return _surface("sglang", installed_server_surface)


@functools.lru_cache(maxsize=None)
def router_surface() -> Surface:
    return _surface("sglang-router", installed_router_surface)


def _kwargs(o: Option, surface: Surface) -> dict:
    if o.kind == "store_true":
        return {"action": "store_true", "default": o.default}
    if o.kind == "store_false":
        return {"action": "store_false", "default": o.default}
    if o.kind == "bool_optional":
        return {"action": argparse.BooleanOptionalAction, "default": o.default}
    typ = surface.types.get(o.dest) or _TYPES.get(o.type or "str", str)
    kw = {"type": typ, "default": o.default, "nargs": o.nargs}
    if o.choices is not None:
        kw["choices"] = o.choices
    return kw


def add_server_options(parser: argparse.ArgumentParser, surface: Surface | None = None) -> None:
    """Every SGLang server option as --sglang-<option> (dest sglang_<field>), except the reserved ones and
    the ones the parser already defines (slime's typed --sglang-* flags win)."""
    surface = surface or server_surface()
    group = parser.add_argument_group(
        f"SGLang server options (all of SGLang {surface.version}'s, as --sglang-<option>; not listed here)")
    have = set(surface.by_flag())
    for o in surface.options:
        if o.name in RESERVED:
            continue
        if f"--sglang-{o.name}" in parser._option_string_actions:
            continue  # slime defines it (typed, with help)
        flags = [f"--sglang-{f}" for f in o.flags]
        flags += [f"--sglang-{old}" for old, new in RENAMED.items() if new in o.flags and old not in have]
        flags = [f for f in flags if f not in parser._option_string_actions]
        group.add_argument(*flags, dest=f"sglang_{o.dest}", help=argparse.SUPPRESS, **_kwargs(o, surface))


def add_router_options(parser: argparse.ArgumentParser, surface: Surface | None = None) -> None:
    """Every sglang-router option as --router-<option> (upstream's names), upstream slime's defaults."""
    surface = surface or router_surface()
    group = parser.add_argument_group(
        f"sglang-router options (all of sglang-router {surface.version}'s, as --router-<option>; not listed here)")
    for o in surface.options:
        if o.name in ROUTER_SKIPPED:
            continue
        flags = [f"--{f}" for f in o.flags if f"--{f}" not in parser._option_string_actions]
        if flags:
            kw = _kwargs(o, surface)
            kw["default"] = ROUTER_DEFAULTS.get(o.dest, kw["default"])
            group.add_argument(*flags, dest=o.dest, help=argparse.SUPPRESS, **kw)


def _tokens(flag: str, o: Option, value: Any) -> list[str]:
    if o.kind == "bool_optional":
        return [f"--{flag}" if value else f"--no-{flag}"]
    if o.kind in ("store_true", "store_false"):
        return [f"--{flag}"]
    if isinstance(value, (list, tuple)):
        return [f"--{flag}", *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
    return [f"--{flag}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def given_server_options(args: argparse.Namespace, surface: Surface | None = None) -> dict[str, Any]:
    """{SGLang option name: value} of the surface options whose value differs from SGLang's default."""
    surface = surface or server_surface()
    out = {}
    for o in surface.options:
        value = getattr(args, f"sglang_{o.dest}", o.default)
        if o.name not in RESERVED and value is not None and value != o.default:  # None: slime's typed flag unset
            out[o.name] = value
    return out


def server_option_tokens(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """sglang.launch_server arguments for the options given (SGLang's current spelling)."""
    surface = server_surface()
    options = {o.name: o for o in surface.options}
    out: list[str] = []
    for name, value in given_server_options(args, surface).items():
        if name not in skip:
            out += _tokens(name, options[name], value)
    return out


def router_option_tokens(args: argparse.Namespace) -> list[str]:
    """sglang_router.launch_router arguments for the --router-* options that differ from the router's defaults."""
    surface = router_surface()
    out: list[str] = []
    for o in surface.options:
        if o.name in ROUTER_SKIPPED:
            continue
        value = getattr(args, o.dest, o.default)
        if value != o.default:
            out += _tokens(o.name[len("router-"):] if o.name.startswith("router-") else o.name, o, value)
    return out
