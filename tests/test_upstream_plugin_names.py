"""Every public function and class of upstream slime's plugin-facing modules imports from this project
under the same module path, with parameters an upstream call binds the same way.

The names and parameters are data (tests/data/upstream_plugin_names.json, read from upstream's source with
`ast` at the commit it names; tests/data/record_upstream_plugin_names.py). A parameter list is compatible
when every upstream parameter has the same name, kind and place (a *args / **kwargs of ours may take it),
literal defaults are equal, and any parameter of ours that upstream lacks has a default.

NOT_YET lists what is not implemented here; the test checks it is still absent, so the list (and
docs/plugins.md, which repeats it) stays true as names land."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data", "upstream_plugin_names.json")
with open(DATA) as f:
    RECORD = json.load(f)
ALL = "*"  # the whole module
NOT_YET: dict[str, list[str] | str] = {}  # module -> names (or ALL); empty: every recorded name is implemented
CASES = [(m, n) for m, names in sorted(RECORD["modules"].items()) if NOT_YET.get(m) != ALL
         for n in sorted(names) if n not in NOT_YET.get(m, ())]


def _literal(text):
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False, None


def compatibility_problems(upstream: list[list], ours: inspect.Signature) -> list[str]:
    params = list(ours.parameters.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems, seen = [], set()
    for i, (name, kind, default) in enumerate(u for u in upstream if u[1] not in ("VAR_POSITIONAL", "VAR_KEYWORD")):
        mine = by_name.get(name)
        if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            if i < len(positional) and positional[i].name == name:
                mine = positional[i]
            elif not (var_pos and (var_kw or kind == "POSITIONAL_ONLY")):
                problems.append(f"positional {name!r} (#{i}) not at its place")
                continue
        elif mine is None and not var_kw:
            problems.append(f"keyword {name!r} not accepted")
            continue
        if mine is not None:
            seen.add(name)
            if default is not None and mine.default is inspect.Parameter.empty:
                problems.append(f"{name!r} has upstream's default {default} but none here")
            ok, value = _literal(default) if default is not None else (False, None)
            if ok and mine.default is not inspect.Parameter.empty and mine.default != value:
                problems.append(f"{name!r} defaults to {mine.default!r}, upstream {default}")
    for p in params:
        if p.name not in seen and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                and p.default is inspect.Parameter.empty and p.name not in {u[0] for u in upstream}:
            problems.append(f"extra required parameter {p.name!r}")
    if any(u[1] == "VAR_POSITIONAL" for u in upstream) and not var_pos:
        problems.append("upstream takes *args")
    if any(u[1] == "VAR_KEYWORD" for u in upstream) and not var_kw:
        problems.append("upstream takes **kwargs")
    return problems


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40
    assert sum(len(v) for v in RECORD["modules"].values()) > 150 and len(CASES) >= 50


@pytest.mark.parametrize("module, name", CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_name_imports_with_upstreams_parameters(module, name):
    obj = getattr(importlib.import_module(module), name)
    info = RECORD["modules"][module][name]
    if info["kind"] == "class":
        assert inspect.isclass(obj) or callable(obj), f"{module}.{name} is {obj!r}, upstream's is a class"
    else:
        assert callable(obj), f"{module}.{name} is not callable"
    if info["kind"] == "async function":
        assert inspect.iscoroutinefunction(obj), f"{module}.{name} must be async, as upstream's"
    if info["params"] is not None:
        problems = compatibility_problems(info["params"], inspect.signature(obj))
        assert not problems, f"{module}.{name}: " + "; ".join(problems)


@pytest.mark.parametrize("module", sorted(NOT_YET))
def test_not_yet_list_is_true(module):
    assert module in RECORD["modules"]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        assert NOT_YET[module] == ALL, f"{module} does not import; list it whole"
        return
    assert NOT_YET[module] != ALL, f"{module} now imports: take it off NOT_YET"
    landed = [n for n in NOT_YET[module] if hasattr(mod, n)]
    assert not landed, f"{module}: {landed} now exist; take them off NOT_YET"


def test_compatibility_rule_catches_differences():
    def f(a, b=2, *, c=None): ...
    upstream = [["a", "POSITIONAL_OR_KEYWORD", None], ["b", "POSITIONAL_OR_KEYWORD", "2"],
                ["c", "KEYWORD_ONLY", "None"]]
    assert compatibility_problems(upstream, inspect.signature(f)) == []
    def g(b, a=1, *, c=None): ...
    assert compatibility_problems(upstream, inspect.signature(g))
    def h(a, b=3, *, c=None, d): ...
    assert len(compatibility_problems(upstream, inspect.signature(h))) == 2
