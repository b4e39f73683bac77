"""Records tests/data/upstream_dataset_cases.json: upstream slime's slime/utils/data.py Dataset (text prompts), run
outside this repository with upstream's utils/types.py, on tests/data/dataset_cases.py (ray and the timer are
stand-ins the Dataset does not reach):
    mkdir -p /tmp/up; for f in utils/data.py utils/types.py; do
      git -C UPSTREAM show COMMIT:slime/$f > /tmp/up/$(basename $f); done
    python tests/data/record_upstream_dataset_cases.py /tmp/up COMMIT OUT.json
"""
import json
import os
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataset_cases import run_all  # noqa: E402


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


root, commit, out = sys.argv[1:4]
for name in ("slime", "slime.utils", "slime.observability"):
    module(name)
module("ray")
module("slime.observability.timer", Timer=None)
module("slime.utils.misc", decode_int32_meta_array=None)
for name, file in (("slime.utils.types", "types.py"), ("up", "data.py")):
    m = module(name)
    exec(compile(open(f"{root}/{file}").read(), f"{root}/{file}", "exec"), m.__dict__)
with tempfile.TemporaryDirectory() as d:
    cases = run_all(sys.modules["up"].Dataset, d)
with open(out, "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": commit, "module": "slime/utils/data.py", "cases": cases}, f,
              indent=0)
print(out, sorted(cases))
