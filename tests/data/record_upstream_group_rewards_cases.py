"""Records tests/data/upstream_group_rewards_cases.json: upstream slime's reward post-processing
(`RolloutManager._post_process_rewards` in slime/ray/rollout.py, which holds GRPO's group normalization) on the
rollouts of tests/data/group_rewards_cases.py, run outside this repository's code:
    python tests/data/record_upstream_group_rewards_cases.py UPSTREAM_GIT_DIR COMMIT OUT.json
The method is taken from `git show COMMIT:slime/ray/rollout.py` alone (the module imports Ray and SGLang) and run
with torch on a stand-in manager (no custom post-process function) and stand-in samples whose reward value is
their reward."""

import ast
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from group_rewards_cases import CASES  # noqa: E402

GIT, COMMIT, OUT = sys.argv[1:4]
PATH = "slime/ray/rollout.py"
source = subprocess.run(["git", "-C", GIT, "show", f"{COMMIT}:{PATH}"], check=True, capture_output=True,
                        text=True).stdout
method = next(node for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.FunctionDef) and node.name == "_post_process_rewards")
namespace = {"torch": torch, "Sample": object}
exec(compile(ast.Module(body=[method], type_ignores=[]), PATH, "exec"), namespace)
post_process = namespace["_post_process_rewards"]


class _Sample:
    def __init__(self, reward):
        self.reward = reward

    def get_reward_value(self, args):
        return self.reward


cases = {}
for name, case in CASES.items():
    manager = SimpleNamespace(custom_reward_post_process_func=None, args=SimpleNamespace(**case))
    raw, rewards = post_process(manager, [_Sample(r) for r in case["rewards"]])
    cases[name] = {"raw_rewards": raw, "rewards": rewards}
with open(OUT, "w") as f:
    json.dump({"repository": "THUDM/slime", "commit": COMMIT, "module": PATH,
               "function": "RolloutManager._post_process_rewards", "cases": cases}, f, indent=0)
print(OUT)
