"""Records tests/data/upstream_rollout_data_utils_cases.json from upstream slime's
slime/observability/rollout_data_utils.py, run outside this repository's code (its one import of slime, Sample,
is a minimal stand-in with rollout_id and to_dict/from_dict):
    python tests/data/record_upstream_rollout_data_utils_cases.py UPSTREAM_FILE COMMIT OUT.json
"""
import json
import os
import sys
import tempfile
import types
from types import SimpleNamespace

import numpy as np
import torch


class Sample:
    def __init__(self, rollout_id=None, index=None):
        self.rollout_id, self.index = rollout_id, index

    def to_dict(self):
        return {"index": self.index}

    @staticmethod
    def from_dict(d):
        return Sample(index=d["index"])


for name in ("slime", "slime.utils"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["slime.utils.types"] = types.ModuleType("slime.utils.types")
sys.modules["slime.utils.types"].Sample = Sample
up = types.ModuleType("up")
exec(open(sys.argv[1]).read(), up.__dict__)


def outcome(fn, *args):
    try:
        fn(*args)
        return None
    except (ValueError, AssertionError) as e:
        return [type(e).__name__, str(e)]


def tensors(values):
    return [{"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist(), "contiguous": t.is_contiguous()}
            for t in values]


cases = []
rnd = np.random.default_rng(3)
data = {"tokens": [[1, 2, 3], np.array([4, 5], dtype=np.int32)], "loss_masks": [[1, 0, 1], [True, False]],
        "rollout_log_probs": [[-0.5, -1.25], np.array([-2.0], dtype=np.float64)],
        "rollout_top_p_token_ids": [[7, 8]], "rollout_top_p_token_offsets": [[0, 2]],
        "teacher_log_probs": [[-0.125]], "rollout_routed_experts": [np.array([[[1, 2]], [[3, 4]]], dtype=np.int16)],
        "rollout_mask_sums": [3, 1], "response_lengths": [3, 2],
        "multimodal_train_inputs": [None, {"pixel_values": np.array([[0.5, 1.5]], dtype=np.float32), "n": 2}]}
inp = {k: [v.tolist() if isinstance(v, np.ndarray) else v for v in vs] if isinstance(vs, list) else vs
       for k, vs in data.items() if k != "multimodal_train_inputs"}
inp["multimodal_train_inputs"] = [None, {"pixel_values": [[0.5, 1.5]], "n": 2}]  # pixel_values: float32 array
dtypes = {"tokens": [None, "int32"], "rollout_log_probs": [None, "float64"], "rollout_routed_experts": ["int16"]}
up.tensorize_rollout_data_for_training(data)
out = {k: tensors(data[k]) for k in up._ROLLOUT_DATA_TENSOR_DTYPES}
out["rollout_mask_sums"] = tensors([data["rollout_mask_sums"]])[0]
out["response_lengths"] = data["response_lengths"]
mm = data["multimodal_train_inputs"]
out["multimodal_train_inputs"] = [None, {"pixel_values": tensors([mm[1]["pixel_values"]])[0], "n": mm[1]["n"]}]
cases.append({"fn": "tensorize_rollout_data_for_training", "input": inp, "numpy_dtypes": dtypes, "out": out})

for spec in ([], [{"shape": [3, 4, 2]}], [{"shape": [3, 4, 2]}, {"shape": [2, 4, 2], "zero_layers": [1, 3]}],
             [{"shape": [2, 4, 1], "zero_layers": [0, 1, 2, 3]}], [{"shape": [0, 4, 2]}], [{"shape": [3, 4]}],
             [{"shape": [3, 5, 2]}], [{"shape": [2, 4, 2], "zero_layers": [0]}]):
    for freq in (None, [0, 1, 1, 1], [1, 0, 1, 0, 1]):
        experts = []
        for s in spec:
            t = torch.ones(s["shape"], dtype=torch.int32)
            for layer in s.get("zero_layers", []):
                t[:, layer, :] = 0
            experts.append(t)
        args = SimpleNamespace(num_layers=4, moe_router_topk=2 if all(s["shape"][-1] != 1 for s in spec) else 1)
        if freq is not None:
            args.moe_layer_freq = freq
        cases.append({"fn": "validate_rollout_routed_experts_for_replay", "experts": spec, "args": vars(args),
                      "out": outcome(up.validate_rollout_routed_experts_for_replay, experts, args)})


def build(node):
    return [build(n) for n in node] if isinstance(node, list) else Sample(rollout_id=node["rid"])


S = {"rid": 5}
N = {"rid": None}
for tree in ([[S, S]], [[S, N]], [[[S, S]]], [[[S, N]]], [[[S, {"rid": 6}]]], [[[N]]], [[[[S, {"rid": 2}]]]],
             [[S], [[S, S], [{"rid": 1}, {"rid": 1}]]], [], [[]], [[[]]], S, [[S, "x"]], ["x"]):
    try:
        built = build(tree) if isinstance(tree, list) else Sample(rollout_id=5)
    except Exception:
        continue
    cases.append({"fn": "validate_rollout_id_annotated", "tree": tree,
                  "out": outcome(up.validate_rollout_id_annotated, built)})

with tempfile.TemporaryDirectory() as tmp:
    template = os.path.join(tmp, "r_{rollout_id}.pt")
    for n in (1, 2, 5, 10, 11):
        torch.save({"rollout_id": 3, "samples": [Sample(index=i).to_dict() for i in range(n)]},
                   template.format(rollout_id=3))
        for ratio in (None, 1.0, 0.5, 0.3, 0.25, 0.1):
            got = up.load_debug_rollout_data(template, rollout_id=3, subsample_ratio=ratio)
            cases.append({"fn": "load_debug_rollout_data", "n": n, "subsample_ratio": ratio,
                          "out": [s.index for s in got]})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/observability/rollout_data_utils.py",
           "recorded_with": "upstream's file run on these inputs (torch, numpy; Sample a stand-in), outside this "
           "repository", "cases": cases}, open(sys.argv[3], "w"), indent=0)
print(len(cases))
