"""Layering of slime/ and slime_plugins/: no import circle, counting the imports inside functions too (they run
when called: a circle through them still ties the modules together); configuration above the components (they
never import slime.config back), and one source of every default (no getattr(args, name, default))."""

from __future__ import annotations

import ast
import functools
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("slime", "slime_plugins")

# Modules above the configuration: the entry points that parse flags, and upstream's import path of parse_args.
CONFIG_USERS = {
    "slime/train.py", "slime/train_async.py", "slime/dry_run.py",
    "slime/utils/arguments.py",  # upstream's `from slime.utils.arguments import parse_args`
    "slime/backends/megatron/checkpoint/convert.py",  # a command-line tool: reads train.py's flags
    "slime/backends/megatron/checkpoint_convert.py",  # the same tool before the checkpoint package
}
# Where getattr(args, name, default) may stay (test_one_source_of_every_default): the configuration layer, which
# builds the namespace, and modules of upstream's plugin API (docs/plugins.md's tables), which user code calls with
# namespaces it built itself, as upstream allows.
CONFIG_LAYER_DIRS = ("slime/config/",)
USER_NAMESPACES = {"slime/utils/http_utils.py", "slime/utils/types.py", "slime/rollout/sglang_rollout.py",
                   "slime/rollout/data_source.py", "slime/rollout/rm_hub/__init__.py"}
# Modules still restating defaults although only the run's own args reach them, each with why it is not done yet.
# The list only shrinks: an entry with no such getattr left fails the test.
NOT_YET_CONVERTED: dict[str, str] = {}


# Arrows that close a circle when imports inside functions count, each with why it is there (and what would
# remove it). The list only shrinks: an arrow no longer needed fails test_allowed_arrows_are_still_needed.
ALLOWED_BACK_ARROWS = {
    # Accelerator.apply_patches / revert_patches (the engine, the trainer, 10 test files call them) delegate to
    # the patch registry, which finds each device's declared set through the accelerator registry of Accelerator
    # subclasses. Removed if callers use slime.accelerator.patches.apply_patch_set(acc.name, library) instead.
    ("slime.accelerator.base", "slime.accelerator.patches"): "Accelerator.apply_patches: the device's entry to "
                                                             "its patch set, resolved at call time",
}


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


def _parse(path: str) -> ast.Module:
    """One parse per file version for all the checks here."""
    st = os.stat(path)
    return _parse_version(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _parse_version(path: str, mtime_ns: int, size: int) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


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


def _imports(path: str, name: str, inside_functions: bool = False) -> list[list[str]]:
    """The imports of a module, each as its candidate names (`from a import b`: a.b, else a). Module level: what
    importing the module runs (top-level statements, also inside if/try/with), not `if TYPE_CHECKING:` blocks;
    inside_functions adds the imports in function and method bodies, which run when they are called."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found: list[list[str]] = []

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
            elif inside_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                        ast.For, ast.AsyncFor, ast.While)):
                walk(node.body)
                walk(getattr(node, "orelse", []))
            if isinstance(node, ast.ImportFrom):
                base = _imported(node, package)[0]
                found.extend([f"{base}.{a.name}", base] for a in node.names)
            elif isinstance(node, ast.Import):
                found.extend([a.name] for a in node.names)

    walk(_parse(path).body)
    return found


def _resolve(candidates: list[str], mods: dict[str, str]) -> str | None:
    """The module an import names: `from pkg import sub` is the submodule when there is one (the package's
    own body is not what the importer uses), a name inside a module is that module."""
    for target in candidates:
        while target and target not in mods:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        if target:
            return target
    return None


def import_graph(repo: str = REPO, roots=ROOTS, inside_functions: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `roots` it imports (at module level; with inside_functions also in function
    bodies): an imported name resolves to its module."""
    mods = _modules(repo, roots)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {_resolve(c, mods) for c in _imports(path, name, inside_functions)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]], allowed=()) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None; `allowed` arrows (a, b) are left out."""
    allowed = set(allowed)
    graph = {a: {b for b in targets if (a, b) not in allowed} for a, targets in graph.items()}
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


@functools.lru_cache(maxsize=2)
def _repo_graph(inside_functions: bool) -> dict[str, set[str]]:
    return import_graph(inside_functions=inside_functions)


def test_no_import_circle_at_module_level():
    graph = _repo_graph(False)
    assert len(graph) > 150 and sum(map(len, graph.values())) > 200  # the walk sees the code base
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import circle: " + " -> ".join(cycle)


def test_no_import_circle_counting_imports_inside_functions():
    graph = _repo_graph(True)
    assert sum(map(len, graph.values())) > sum(map(len, _repo_graph(False).values())) + 150  # function imports seen
    cycle = find_cycle(graph, ALLOWED_BACK_ARROWS)
    assert cycle is None, ("import circle (imports inside functions count): " + " -> ".join(cycle) + "; move the "
                           "shared name below both modules, or pass it in")


def test_allowed_arrows_are_still_needed():
    graph = _repo_graph(True)
    gone = [f"{a} -> {b}" for a, b in ALLOWED_BACK_ARROWS if b not in graph.get(a, ())]
    assert not gone, "no longer imported; delete from ALLOWED_BACK_ARROWS: " + ", ".join(gone)
    # and each one still closes a circle (else it is an arrow down, which needs no entry)
    for arrow in ALLOWED_BACK_ARROWS:
        rest = set(ALLOWED_BACK_ARROWS) - {arrow}
        assert find_cycle(graph, rest) is not None, f"{arrow} closes no circle; delete it from ALLOWED_BACK_ARROWS"


def _plant(tmp_path, files: dict[str, str]) -> str:
    for rel, text in {"slime/__init__.py": "", "slime/a/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_cycle_detector_finds_a_planted_circle(tmp_path):
    repo = _plant(tmp_path, {
        "slime/a/one.py": "from slime.a.two import g\n\ndef f():\n    from slime.a import three\n",
        "slime/a/two.py": "import os\nif True:\n    from . import three\n",
        "slime/a/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slime.a import one\n"
                            "try:\n    from .one import f\nexcept ImportError:\n    pass\n"})
    graph = import_graph(repo, ("slime",))
    assert graph["slime.a.one"] == {"slime.a.two"}  # the function-level import is not an edge at module level
    assert graph["slime.a.two"] == {"slime.a.three"}  # `from . import three` names the module, not the package
    assert graph["slime.a.three"] == {"slime.a.one"}  # TYPE_CHECKING is not, the try-block is
    assert find_cycle(graph) == ["slime.a.one", "slime.a.two", "slime.a.three", "slime.a.one"]
    (tmp_path / "slime" / "a" / "three.py").write_text("x = 1\n")
    assert find_cycle(import_graph(repo, ("slime",))) is None


def test_a_circle_through_an_import_inside_a_function_fails(tmp_path):
    repo = _plant(tmp_path, {
        "slime/a/low.py": "class Helper:\n    def use(self):\n        if True:\n"
                          "            from slime.a.high import run  # back up, at call time\n        return run\n",
        "slime/a/high.py": "from slime.a.low import Helper\n\ndef run():\n    return Helper\n"})
    assert find_cycle(import_graph(repo, ("slime",))) is None  # invisible at module level
    graph = import_graph(repo, ("slime",), inside_functions=True)
    assert graph["slime.a.low"] == {"slime.a.high"}
    assert find_cycle(graph) == ["slime.a.high", "slime.a.low", "slime.a.high"]
    assert find_cycle(graph, {("slime.a.low", "slime.a.high")}) is None  # an allowed arrow is left out


def _relpath(path: str) -> str:
    return os.path.relpath(path, REPO).replace(os.sep, "/")


def test_components_never_import_the_configuration():
    """slime.config may import the components it configures; they never import it back (at any level)."""
    hits = []
    for name, path in _modules(REPO).items():
        rel = _relpath(path)
        if name.startswith("slime.config") or rel in CONFIG_USERS:
            continue
        tree = _parse(path)
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if any(t == "slime.config" or t.startswith("slime.config.") for t in _imported(node, package)):
                hits.append(f"{rel}:{node.lineno}")
    assert not hits, "components importing slime.config (pass the value in args, or move it below): " + ", ".join(hits)


# The names a run's namespace goes by: args, self.args, a (the usual local alias), critic_args, ...
NAMESPACE_NAMES = {"args", "a", "ns", "namespace"}


def _is_namespace(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name in NAMESPACE_NAMES or name.endswith("_args"))


def getattr_defaults(path: str) -> list[tuple[int, str]]:
    """(line, code) of every getattr(<namespace>, <name>, <default>) in a module: a literal name, one in a
    variable or computed (getattr(args, f.name, f.default)) alike."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(_parse(path))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) == 3 and _is_namespace(node.args[0]))


def _may_restate_defaults(rel: str) -> bool:
    return rel.startswith(CONFIG_LAYER_DIRS) or rel in USER_NAMESPACES or rel in NOT_YET_CONVERTED


def test_one_source_of_every_default():
    """Parsed args carry every flag at its parser default: restating it (getattr(args, "x", default), also with
    the flag's name in a variable) lets the two drift; components read args.x. Only the configuration layer and
    modules of upstream's plugin API, which user code calls with namespaces of its own, may."""
    hits = []
    for path in _modules(REPO).values():
        rel = _relpath(path)
        if not _may_restate_defaults(rel):
            hits += [f"{rel}:{line}: {code}" for line, code in getattr_defaults(path)]
    assert not hits, ("getattr(args, name, default) restates a parser default; read args.name (build test "
                      "namespaces with the parser):\n" + "\n".join(hits))


def test_allowed_getattr_modules_are_plugin_api_and_still_need_it():
    with open(os.path.join(REPO, "docs", "plugins.md"), encoding="utf-8") as f:
        plugins_doc = f.read()
    for rel in USER_NAMESPACES:
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        assert f"`{module}" in plugins_doc, f"{rel} is not in docs/plugins.md's plugin API: drop it from USER_NAMESPACES"
    done = [rel for rel in NOT_YET_CONVERTED if not getattr_defaults(os.path.join(REPO, rel))]
    assert not done, "no getattr(args, name, default) left; delete from NOT_YET_CONVERTED: " + ", ".join(done)


def test_getattr_scan_finds_planted_defaults(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(args, self, sample, fields):\n"
                    "    x = getattr(args, 'x', 1) + getattr(self.args, 'y', None)\n"
                    "    o = {f.name: getattr(args, f.name, f.default) for f in fields}\n"
                    "    c = getattr(args.critic_args, 'lr', 0.1) or getattr(a, 'k' + 'z', 0)\n"
                    "    return getattr(args, 'x'), getattr(sample, 'index', 0), getattr(self, 'z', None)\n")
    assert [line for line, _ in getattr_defaults(str(path))] == [2, 2, 3, 4, 4]
