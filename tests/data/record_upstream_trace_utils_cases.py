"""Records tests/data/upstream_trace_utils_cases.json: upstream slime's slime/observability/trace_utils.py (with
upstream's utils/types.py for Sample, from the same commit), run outside this repository on the scenarios of
tests/data/trace_scenarios.py:
    mkdir -p /tmp/up; for f in observability/trace_utils.py utils/types.py; do
      git -C UPSTREAM show COMMIT:slime/$f > /tmp/up/$(basename $f); done
    python tests/data/record_upstream_trace_utils_cases.py /tmp/up COMMIT OUT.json
"""
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_scenarios import run_all  # noqa: E402


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


root, commit, out = sys.argv[1:4]
for name in ("slime", "slime.utils", "slime.observability"):
    module(name)
module("slime.utils.misc", decode_int32_meta_array=None)
for name, file in (("slime.utils.types", "types.py"), ("up", "trace_utils.py")):
    m = module(name)
    exec(compile(open(f"{root}/{file}").read(), f"{root}/{file}", "exec"), m.__dict__)
up = sys.modules["up"]
record = {"repository": "THUDM/slime", "commit": commit, "module": "slime/observability/trace_utils.py",
          "scenarios": run_all(up, sys.modules["slime.utils.types"].Sample)}
with open(out, "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
print(f"{len(record['scenarios'])} scenarios -> {out}")
