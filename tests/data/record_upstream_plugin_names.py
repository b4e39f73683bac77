"""Records tests/data/upstream_plugin_names.json: every public top-level function and class (with its
constructor's or call's parameters) of upstream slime's plugin-facing modules, read from upstream's source
with `ast` (nothing of upstream is imported or run):
    python tests/data/record_upstream_plugin_names.py UPSTREAM_GIT_DIR COMMIT OUT.json
tests/test_upstream_plugin_names.py imports each name from this project and compares the parameters.
"""

import ast
import json
import subprocess
import sys

MODULES = [
    "slime.utils.ppo_utils", "slime.utils.types", "slime.utils.http_utils", "slime.utils.misc",
    "slime.utils.mask_utils", "slime.utils.async_utils", "slime.utils.data", "slime.utils.eval_config",
    "slime.utils.processing_utils", "slime.utils.accelerator", "slime.rollout.base_types",
    "slime.rollout.sglang_rollout", "slime.rollout.data_source", "slime.rollout.filter_hub.base_types",
    "slime.rollout.filter_hub.dynamic_sampling_filters", "slime.rollout.fully_async_rollout",
    "slime.rollout.rm_hub", "slime.backends.megatron_utils.cp_utils", "slime.observability.trace_utils",
    "slime.observability.rollout_metrics", "slime.observability.rollout_data_utils",
    "slime.observability.train_data_utils", "slime.observability.metric_utils",
    "slime.agent.parsing", "slime.agent.trajectory", "slime.agent.sandbox", "slime.agent.aiohttp_threaded",
    "slime.agent.adapters.common", "slime.agent.adapters.anthropic",
    "slime.agent.adapters.openai", "slime.agent.harness.common",
    "slime.agent.harness.claude_code", "slime.agent.harness.codex",
]


def source(git_dir: str, commit: str, module: str) -> str:
    base = module.replace(".", "/")
    for path in (base + ".py", base + "/__init__.py"):
        out = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout
    raise FileNotFoundError(module)


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> list[list]:
    a = fn.args
    rows = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(positional, defaults):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        rows.append([arg.arg, kind, None if d is None else ast.unparse(d)])
    if a.vararg:
        rows.append([a.vararg.arg, "VAR_POSITIONAL", None])
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        rows.append([arg.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)])
    if a.kwarg:
        rows.append([a.kwarg.arg, "VAR_KEYWORD", None])
    return rows[1:] if drop_self and rows and rows[0][0] in ("self", "cls") else rows


def names(tree: ast.Module) -> dict:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            out[node.name] = {"kind": "async function" if isinstance(node, ast.AsyncFunctionDef) else "function",
                              "params": params(node, False)}
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            out[node.name] = {"kind": "class", "params": params(init, True) if init else None}
    return out


def main(git_dir: str, commit: str, out_path: str) -> None:
    record = {"repository": "THUDM/slime", "commit": commit,
              "recorded_with": "tests/data/record_upstream_plugin_names.py (ast over upstream's source)",
              "modules": {m: names(ast.parse(source(git_dir, commit, m))) for m in MODULES}}
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
