"""Records tests/data/upstream_misc_helpers_cases.json: upstream slime's slime/utils/misc.py helpers
(should_run_periodic_action, group_by, chunk_named_params_by_size, Box, exec_command) and utils/types.py's
MultimodalTypes / ParamInfo, run outside this repository on the inputs below:
    mkdir -p /tmp/up; for f in utils/misc.py utils/types.py; do
      git -C UPSTREAM show COMMIT:slime/$f > /tmp/up/$(basename $f); done
    python tests/data/record_upstream_misc_helpers_cases.py /tmp/up COMMIT OUT.json
"""
import dataclasses
import json
import sys
import types

import torch


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


root, commit, out = sys.argv[1:4]
for name in ("slime", "slime.utils"):
    module(name)
module("slime.utils.http_utils", is_port_available=lambda port: True)
for name, file in (("slime.utils.misc", "misc.py"), ("slime.utils.types", "types.py")):
    m = module(name)
    exec(compile(open(f"{root}/{file}").read(), f"{root}/{file}", "exec"), m.__dict__)
misc, tys = sys.modules["slime.utils.misc"], sys.modules["slime.utils.types"]

periodic = [[r, i, e, n, misc.should_run_periodic_action(r, i, e, n)]
            for r in range(0, 13) for i in (None, 1, 3, 5) for e in (None, 4) for n in (None, 7, 13)]
groups = [[items, key, list(map(list, misc.group_by(items, {None: None, "mod3": lambda x: x % 3,
                                                              "sign": lambda x: x > 0}[key]).items()))]
          for items, key in (([3, 1, 3, 2, 1], None), ([5, -1, 4, 9, 0, -7], "mod3"), ([], "sign"), ([2, -2, 2], "sign"))]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
PARAMS = [("a", [4], "float32"), ("b", [2, 3], "bfloat16"), ("c", [64], "int8"), ("d", [1], "float32"),
          ("e", [10], "float32"), ("f", [3], "int8")]
chunks = []
for size in (1, 16, 40, 64, 65, 1000):
    named = [(n, torch.zeros(shape, dtype=DTYPES[d])) for n, shape, d in PARAMS]
    chunks.append([size, [[n for n, _ in bucket] for bucket in misc.chunk_named_params_by_size(named, size)]])
box = misc.Box([1, 2])
execs = [["echo hi; echo err >&2", misc.exec_command("echo hi; echo err >&2", capture_output=True)],
         ["true", misc.exec_command("true")]]
try:
    misc.exec_command("exit 3", capture_output=True)
except Exception as e:
    execs.append(["exit 3", type(e).__name__, e.returncode])
mm = {"all": [dataclasses.asdict(t) for t in tys.MultimodalTypes.all()],
      "get": {n: (dataclasses.asdict(tys.MultimodalTypes.get(n)) if tys.MultimodalTypes.get(n) else None)
              for n in ("image", "video", "audio", "text", "")}}
param_info = [f.name for f in dataclasses.fields(tys.ParamInfo)] + [tys.ParamInfo.__dataclass_params__.frozen]
with open(out, "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": commit, "periodic": periodic, "group_by": groups,
               "chunks": chunks, "box": [box.inner, hasattr(box, "__setattr__")], "exec": execs, "multimodal": mm,
               "param_info": param_info}, f, indent=0)
print(out, len(periodic))
