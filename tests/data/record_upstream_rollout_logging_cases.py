"""Records tests/data/upstream_rollout_logging_cases.json: upstream slime's log_rollout_data / log_eval_rollout_data
(slime/observability/rollout_metrics.py with its metric_utils.py and utils/types.py from the same commit), run outside
this repository on tests/data/rollout_logging_cases.py, its tracker sink (logging_utils.log) capturing each record:
    mkdir -p /tmp/up; for f in observability/rollout_metrics.py observability/metric_utils.py utils/types.py; do
      git -C UPSTREAM show COMMIT:slime/$f > /tmp/up/$(basename $f); done
    python tests/data/record_upstream_rollout_logging_cases.py /tmp/up COMMIT OUT.json
"""
import importlib
import json
import os
import sys
import types
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_logging_cases import run_all  # noqa: E402


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def group_by(iterable, key=None):
    out = defaultdict(list)
    for item in iterable:
        out[key(item) if key is not None else item].append(item)
    return dict(out)


def load_function(path):
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


captured = []
root, commit, out = sys.argv[1:4]
for name in ("slime", "slime.utils", "slime.observability"):
    module(name)
module("slime.utils.misc", group_by=group_by, load_function=load_function, decode_int32_meta_array=None)
module("slime.observability.logging_utils", log=lambda args, metrics, step_key: captured.append([dict(metrics), step_key]))
for name, file in (("slime.utils.types", "types.py"), ("slime.observability.metric_utils", "metric_utils.py"),
                   ("up", "rollout_metrics.py")):
    m = module(name)
    exec(compile(open(f"{root}/{file}").read(), f"{root}/{file}", "exec"), m.__dict__)
Sample = sys.modules["slime.utils.types"].Sample


def build(d):
    d = dict(d)
    s = Sample(status=Sample.Status(d.pop("status")))
    for k, v in d.items():
        setattr(s, k, v)
    return s


cases = run_all(sys.modules["up"], build, captured)
with open(out, "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": commit, "module": "slime/observability/rollout_metrics.py",
               "cases": cases}, f, indent=0)
print(f"{len(cases)} cases -> {out}")
