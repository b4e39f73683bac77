"""docs/architecture.md matches the code: every path it names exists, and it names every module of the run
session package (slime/run/)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
# a repository path: one of these top folders, then path characters (not preceded by a word or a slash, so that
# upstream's folder names, written without this repository's prefix, are not taken for paths here)
PATH = re.compile(r"(?<![\w/.-])((?:slime|slime_plugins|tests|docs|scripts)/[\w./-]*[\w/])")


def named_paths(text: str) -> list[str]:
    return sorted(set(PATH.findall(text)))


def exists(path: str) -> bool:
    """A file, a folder, or a module named without .py (a module or a package of that name)."""
    full = os.path.join(ROOT, path)
    return os.path.exists(full) or (not path.endswith((".py", "/")) and os.path.exists(full + ".py"))


def test_every_path_named_exists():
    with open(DOC, encoding="utf-8") as f:
        paths = named_paths(f.read())
    assert len(paths) > 20, paths  # the page is read (a broken pattern would find nothing and pass)
    missing = [p for p in paths if not exists(p)]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_names_every_module_of_the_run_package():
    with open(DOC, encoding="utf-8") as f:
        paths = set(named_paths(f.read()))
    modules = {f"slime/run/{f}" for f in os.listdir(os.path.join(ROOT, "slime", "run"))
               if f.endswith(".py") and f != "__init__.py"}
    assert modules and not modules - paths, f"docs/architecture.md does not name {sorted(modules - paths)}"


def test_the_pattern_tells_paths_here_from_upstream_names():
    text = ("see `slime/run/session.py` and slime/backends/megatron/weight_sync, upstream's `megatron_utils/` and "
            "`ray/rollout.py` (THUDM/slime), docs/rollout.md.")
    assert named_paths(text) == ["docs/rollout.md", "slime/backends/megatron/weight_sync", "slime/run/session.py"]
    assert exists("slime/run/session.py") and exists("slime/run") and not exists("slime/run/nowhere.py")
