"""Layering of slime/: no import circle at module level, configuration above the components (they never
import slime.config back), and one source of every default (no getattr(args, name, default))."""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("slime", "slime_plugins")

# Modules above the configuration: the entry points that parse flags, and upstream's import path of parse_args.
CONFIG_USERS = {
    "slime/train.py", "slime/train_async.py", "slime/dry_run.py",
    "slime/utils/arguments.py",  # upstream's `from slime.utils.arguments import parse_args`
    "slime/backends/megatron/checkpoint_convert.py",  # a command-line tool: reads train.py's flags
}
# Upstream's plugin API: user code hands these modules namespaces it built itself, as upstream allows.
USER_NAMESPACES = {"slime/utils/http_utils.py", "slime/utils/types.py", "slime/rollout/sglang_rollout.py",
                   "slime/rollout/plugin_rollout.py", "slime/rollout/data_source.py"}
USER_NAMESPACE_DIRS = ("slime/rollout/rm_hub/",)


def _modules(repo: str, roots=ROOTS) -> dict[str, str]:
    out = {}
    for root in roots:
        for dirpath, _, files in os.walk(os.path.join(repo, root)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, repo)[:-3].replace(os.sep, ".")
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def _module_level_imports(path: str, name: str) -> list[str]:
    """What importing the module runs: top-level statements (also inside if/try), not function bodies,
    not `if TYPE_CHECKING:` blocks."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found: list[str] = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                walk(node.body)
                walk(getattr(node, "orelse", []))
                walk(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    walk(handler.body)
            found.extend(_imported(node, package))

    with open(path, encoding="utf-8") as f:
        walk(ast.parse(f.read()).body)
    return found


def import_graph(repo: str = REPO, roots=ROOTS) -> dict[str, set[str]]:
    """module -> the modules of `roots` it imports at module level (an imported name resolves to its module)."""
    mods = _modules(repo, roots)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for target in _module_level_imports(path, name):
            while target and target not in mods:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_at_module_level():
    graph = import_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 200  # the walk sees the code base
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import circle: " + " -> ".join(cycle)


def test_cycle_detector_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "slime" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "slime" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text("from slime.a.two import g\n\ndef f():\n    from slime.a import three\n")
    (pkg / "two.py").write_text("import os\nif True:\n    from . import three\n")
    (pkg / "three.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slime.a import one\n"
                                  "try:\n    from .one import f\nexcept ImportError:\n    pass\n")
    graph = import_graph(str(tmp_path), ("slime",))
    assert graph["slime.a.one"] == {"slime.a.two"}  # the function-level import is not an edge
    assert graph["slime.a.three"] == {"slime.a.one"}  # TYPE_CHECKING is not, the try-block is
    assert find_cycle(graph) == ["slime.a.one", "slime.a.two", "slime.a.three", "slime.a.one"]
    (pkg / "three.py").write_text("x = 1\n")
    assert find_cycle(import_graph(str(tmp_path), ("slime",))) is None


def _relpath(path: str) -> str:
    return os.path.relpath(path, REPO).replace(os.sep, "/")


def test_components_never_import_the_configuration():
    """slime.config may import the components it configures; they never import it back (at any level)."""
    hits = []
    for name, path in _modules(REPO).items():
        rel = _relpath(path)
        if name.startswith("slime.config") or rel in CONFIG_USERS:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if any(t == "slime.config" or t.startswith("slime.config.") for t in _imported(node, package)):
                hits.append(f"{rel}:{node.lineno}")
    assert not hits, "components importing slime.config (pass the value in args, or move it below): " + ", ".join(hits)


GETATTR_DEFAULT = re.compile(r"getattr\((?:self\.)?(?:args|a|self\.args), *[\"'][a-z_0-9]+[\"'], *[^)]")


def test_one_source_of_every_default():
    """Parsed args carry every flag at its parser default: restating it (getattr(args, "x", default)) lets the
    two drift. Checked in the components; modules of upstream's plugin API, which user code calls with
    namespaces of its own, may (and so, for now, may slime.config's preflight, whose tests pass partial ones)."""
    hits = []
    for path in _modules(REPO).values():
        rel = _relpath(path)
        if rel in USER_NAMESPACES or rel.startswith(USER_NAMESPACE_DIRS + ("slime/config/",)):
            continue
        with open(path, encoding="utf-8") as f:
            hits += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if GETATTR_DEFAULT.search(line)]
    assert not hits, "getattr(args, name, default) restates a parser default; read args.name:\n" + "\n".join(hits)
