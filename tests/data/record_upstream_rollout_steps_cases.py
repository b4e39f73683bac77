"""Records tests/data/upstream_rollout_steps_cases.json: how upstream slime splits a rollout's samples into
optimizer steps, on the rollouts of tests/data/rollout_steps_cases.py, run outside this repository's code:
    python tests/data/record_upstream_rollout_steps_cases.py UPSTREAM_GIT_DIR COMMIT OUT.json
Two upstream pieces, taken from `git show COMMIT:...`: the rollout ids the manager gives its samples
(`RolloutManager._convert_samples_to_train_data` in slime/ray/rollout.py, run alone on a stand-in manager and
stand-in samples; the module imports Ray and SGLang) and the step split (`build_dp_schedule` in
slime/utils/dp_schedule.py with the two modules it imports, written to a temporary directory), at one data-parallel
rank with fixed micro-batches of one sample, so that each step's micro-batch count is its sample count."""

import ast
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_steps_cases import CASES  # noqa: E402

GIT, COMMIT, OUT = sys.argv[1:4]


def show(path: str) -> str:
    return subprocess.run(["git", "-C", GIT, "show", f"{COMMIT}:{path}"], check=True, capture_output=True,
                          text=True).stdout


root = tempfile.mkdtemp()
os.makedirs(os.path.join(root, "slime", "utils"))
for name in ("__init__", "dp_schedule", "flops_utils", "seqlen_balancing"):
    with open(os.path.join(root, "slime", "utils", f"{name}.py"), "w") as f:
        f.write("" if name == "__init__" else show(f"slime/utils/{name}.py"))
open(os.path.join(root, "slime", "__init__.py"), "w").close()
sys.path.insert(0, root)
from slime.utils.dp_schedule import build_dp_schedule  # noqa: E402

ROLLOUT = "slime/ray/rollout.py"
method = next(node for node in ast.walk(ast.parse(show(ROLLOUT)))
              if isinstance(node, ast.FunctionDef) and node.name == "_convert_samples_to_train_data")
Sample = SimpleNamespace(Status=SimpleNamespace(TRUNCATED="truncated"))
namespace = {"torch": torch, "Sample": Sample}
exec(compile(ast.Module(body=[method], type_ignores=[]), ROLLOUT, "exec"), namespace)
convert = namespace["_convert_samples_to_train_data"]


def stand_in(i: int, rollout_id) -> SimpleNamespace:
    n = 1 + i % 3
    return SimpleNamespace(rollout_id=rollout_id, tokens=[3] * (n + 2), response_length=n, status="completed",
                           index=i, loss_mask=[1] * n, remove_sample=False, metadata=None, rollout_log_probs=None,
                           rollout_routed_experts=None, train_metadata=None, multimodal_train_inputs=None,
                           teacher_log_probs=None, reward=0.0)


manager = SimpleNamespace(custom_convert_samples_to_train_data_func=None, args=SimpleNamespace(rollout_top_p=1.0),
                          _post_process_rewards=lambda samples: ([s.reward for s in samples],) * 2)
config = {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
schedule_args = SimpleNamespace(use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=1,
                                balance_data=False, balance_by_flops=False)
cases = {}
for name, case in CASES.items():
    data = convert(manager, [stand_in(i, r) for i, r in enumerate(case["rollout_ids"])])
    partitions, _, num_microbatches, global_batch_sizes = build_dp_schedule(
        schedule_args, config, [len(t) for t in data["tokens"]], global_batch_size=case["global_batch_size"],
        rollout_indices=data["rollout_ids"])
    steps, at = [], 0
    for count in num_microbatches:
        steps.append(partitions[0][at:at + count])
        at += count
    cases[name] = {"rollout_ids": data["rollout_ids"], "steps": steps, "global_batch_sizes": global_batch_sizes}
with open(OUT, "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": COMMIT,
               "functions": ["RolloutManager._convert_samples_to_train_data (slime/ray/rollout.py)",
                             "build_dp_schedule (slime/utils/dp_schedule.py)"], "cases": cases}, f, indent=0)
print(OUT)
