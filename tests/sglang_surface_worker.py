"""Run in a fresh interpreter: import the installed SGLang's real ServerArgs and report.

`sglang/__init__.py` and `sglang/srt/utils/common.py` import GPU-only packages (triton) at module level
(0.5.23). Only in this throw-away process: `sglang` is entered in sys.modules as a bare package (its
`__init__` does not run) and `triton` as an empty module, after torch._dynamo has been imported (it then
already knows triton is absent). Nothing of this reaches the product code or the test process.

    python tests/sglang_surface_worker.py OUT.json                the live server and router surfaces
    python tests/sglang_surface_worker.py ARGV.json OUT.json      ... and parse_args of each argv with them
    python tests/sglang_surface_worker.py --write-record          rewrite slime/config/sglang_options.json
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types


def _import_real_server_args():
    import torch._dynamo  # noqa: F401  (decides there is no triton before the stand-in exists)

    sys.modules.setdefault("triton", types.ModuleType("triton"))
    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [root]
    sys.modules["sglang"] = pkg
    from sglang.srt.server_args import ServerArgs

    return ServerArgs


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


SAMPLES = {"human_readable_int": ["4096", "32k", "25.6k", "1Ki", "2Mi", "1G"], "nullable_str": ["", "None", "x"],
           "json_list_type": ['[1, 2]', '["a"]']}


def main(argv: list[str]) -> None:
    server_args = _import_real_server_args()
    from sglang.srt.utils import common

    from slime.config import sglang_options as so

    server = so.installed_server_surface()
    router = so.installed_router_surface()
    out = {"server_args_type": type(server_args).__name__, "server_args_module": server_args.__module__,
           "sglang": so.surface_to_json(server), "sglang-router": so.surface_to_json(router),
           "parsers": {name: [[_plain(getattr(common, name)(v)), _plain(so._TYPES[name](v))] for v in values]
                       for name, values in SAMPLES.items()}}
    if len(argv) == 2:
        # parse with the live surface although its version is the recorded one
        so.server_surface = lambda: server
        so.router_surface = lambda: router
        from slime.config.arguments import parse_args

        out["namespaces"] = []
        for args in json.loads(open(argv[0]).read()):
            ns = vars(parse_args(args))
            out["namespaces"].append({k: [type(v).__name__, _plain(v)] for k, v in ns.items()
                                      if k not in ("hf_config", "sglang_deployments")})
    if argv[0] == "--write-record":  # regenerate slime/config/sglang_options.json, one option a line
        lines = ['{"_comment": "SGLang\'s and sglang-router\'s option surfaces, recorded from the installed packages by '
                 'tests/sglang_surface_worker.py --write-record (tests/test_sglang_options.py keeps it equal to them); '
                 'read by slime/config/sglang_options.py",']
        for i, package in enumerate(("sglang", "sglang-router")):
            data = out[package]
            lines.append(f'"{package}": {{"package": "{package}", "version": "{data["version"]}", "options": [')
            lines.append(",\n".join(json.dumps(o, sort_keys=True) for o in data["options"]))
            lines.append("]}" + ("," if i == 0 else ""))
        text = "\n".join(lines) + "\n}\n"
        json.loads(text)
        with open(so.RECORD, "w") as f:
            f.write(text)
        return
    with open(argv[-1], "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
