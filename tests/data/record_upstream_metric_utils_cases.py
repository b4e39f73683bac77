"""Records tests/data/upstream_metric_utils_cases.json from upstream slime's slime/observability/metric_utils.py
(run outside this repository's code): python tests/data/record_upstream_metric_utils_cases.py UPSTREAM_FILE COMMIT OUT.json
"""
import json
import random
import sys
import types
from types import SimpleNamespace
up = types.ModuleType("up")
exec(open(sys.argv[1]).read(), up.__dict__)
rnd = random.Random(7)
cases = []
for gs, ng in ((1, 3), (2, 3), (4, 5), (8, 2), (6, 3), (16, 2)):
    flat = [rnd.choice([0, 1, 1, 0.5, -1]) for _ in range(gs * ng)]
    cases.append({"fn": "compute_pass_rate", "args": [flat, gs], "out": {k: float(v) for k, v in up.compute_pass_rate(flat, gs).items()}})
for vals in ([1.0], [3, 1, 2], [0.5, -2.0, 7.25, 1.0], [rnd.random() for _ in range(9)]):
    cases.append({"fn": "compute_statistics", "args": [vals], "out": up.compute_statistics(vals)})
texts = ["", "abc", "hello world " * 50, "".join(chr(65 + rnd.randrange(26)) for _ in range(3000))]
for t in texts:
    for alg in ("zlib", "gzip", "bz2", "lzma"):
        cases.append({"fn": "compression_ratio", "args": [t], "kwargs": {"algorithm": alg}, "out": list(up.compression_ratio(t, algorithm=alg))})
for t in ("ab" * 6000, "".join(chr(65 + rnd.randrange(26)) for _ in range(12000)), "x" * 9999):
    cases.append({"fn": "has_repetition", "args": [t], "out": up.has_repetition(t)})
for flag in (False, True):
    a = {"wandb_always_use_train_step": flag, "rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 12}
    cases.append({"fn": "compute_rollout_step", "args": [{"namespace": a}, 5], "out": up.compute_rollout_step(SimpleNamespace(**a), 5)})
cases.append({"fn": "dict_add_prefix", "args": [{"a": 1, "b": 2}, "eval/"], "out": up.dict_add_prefix({"a": 1, "b": 2}, "eval/")})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/observability/metric_utils.py",
           "recorded_with": "upstream's file run on these inputs (numpy only), outside this repository", "cases": cases},
          open(sys.argv[3], "w"), indent=0)
print(len(cases))
