"""Regenerate upstream_arguments_flags.json: every flag upstream slime's slime/utils/arguments.py defines
(`parser.add_argument("--name", ...)`, first spelling), in file order, read from its source with ast.

    python tests/data/capture_upstream_flags.py /path/to/THUDM/slime.git COMMIT > tests/data/upstream_arguments_flags.json
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys


def flags(source: str) -> list[dict]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            if names:
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg in ("action", "type", "default", "nargs")}
                out.append({"flag": names[0], "line": node.lineno, **kw})
    return sorted(out, key=lambda f: f["line"])


if __name__ == "__main__":
    repo, commit = sys.argv[1], sys.argv[2]
    src = subprocess.run(["git", "-C", repo, "show", f"{commit}:slime/utils/arguments.py"], check=True,
                         capture_output=True, text=True).stdout
    print(json.dumps({"repository": "THUDM/slime", "commit": commit, "file": "slime/utils/arguments.py",
                      "flags": flags(src)}, indent=0))
