"""Records tests/data/upstream_train_dump_cases.json: upstream slime's train-dump payload
(slime/observability/train_data_utils.py `_build_dump_payload`), run outside this repository on the DP shards of
tests/data/train_dump_cases.py:
    git -C UPSTREAM show COMMIT:slime/observability/train_data_utils.py > /tmp/up/train_data_utils.py
    python tests/data/record_upstream_train_dump_cases.py /tmp/up/train_data_utils.py COMMIT OUT.json
"""
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_dump_cases import run_all  # noqa: E402

up = sys.modules["up"] = types.ModuleType("up")
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), up.__dict__)
with open(sys.argv[3], "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/observability/train_data_utils.py",
               "function": "_build_dump_payload", "cases": run_all(up._build_dump_payload)}, f, indent=0)
print(sys.argv[3])
