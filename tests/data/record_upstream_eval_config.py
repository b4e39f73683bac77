"""Records tests/data/upstream_eval_config.json: upstream slime's --eval-config resolution (its
slime/utils/eval_config.py, which imports nothing of slime) on this file's args and config, with the list of
keys its EvalDatasetConfig accepts.

Run against upstream's own code, outside this repository (the project never imports it):
    git -C UPSTREAM show COMMIT:slime/utils/eval_config.py > /tmp/up/upstream_eval_config.py
    python tests/data/record_upstream_eval_config.py /tmp/up COMMIT
tests/test_upstream_rollout_flags.py checks that slime.rollout.eval_datasets resolves the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from types import SimpleNamespace

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_eval_config.json")


def main(root: str, commit: str) -> None:
    sys.path.insert(0, root)
    import upstream_eval_config as u

    args = SimpleNamespace(n_samples_per_eval_prompt=2, n_samples_per_prompt=4, eval_temperature=None, rollout_temperature=0.9,
        eval_top_p=0.95, rollout_top_p=1.0, eval_top_k=None, rollout_top_k=-1, eval_max_response_len=None,
        rollout_max_response_len=24, rollout_stop=["</s>"], rollout_stop_token_ids=None, eval_min_new_tokens=3,
        eval_input_key=None, input_key="prompt", eval_label_key="answer", label_key="label", eval_tool_key=None,
        tool_key="tools", metadata_key="metadata", multimodal_keys=None, apply_chat_template=True,
        apply_chat_template_kwargs={"enable_thinking": False}, eval_custom_rm_path=None, custom_rm_path=None)
    config = {"eval": {"defaults": {"temperature": 0.6, "max_response_len": 16, "rm_type": "math"},
                       "datasets": [
        {"name": "aime", "path": "aime.jsonl", "n_samples_per_eval_prompt": 8, "top_k": 20, "min_new_tokens": 5,
         "stop_token_ids": [7], "repetition_penalty": 1.1, "metadata_overrides": {"level": "hard"}},
        {"name": "gpqa", "path": "gpqa.jsonl", "rm_type": "gpqa", "input_key": "question", "temperature": 0.0,
         "custom_rm_path": "pkg.mod.reward", "skip_special_tokens": True, "no_stop_trim": False,
         "apply_chat_template": False, "custom_generate_function_path": "pkg.mod.generate"}]}}
    eval_cfg = config["eval"]
    ds = u.build_eval_dataset_configs(args, u.ensure_dataset_list(eval_cfg["datasets"]), eval_cfg["defaults"])
    fields = [f.name for f in dataclasses.fields(u.EvalDatasetConfig)]
    out = {"repository": "THUDM/slime", "commit": commit,
           "file": "slime/utils/eval_config.py", "recorded_by": "tests/data/record_upstream_eval_config.py",
           "EvalDatasetConfig_fields": fields, "args": vars(args), "config": config,
           "resolved": [dataclasses.asdict(d) for d in ds],
           "metadata": [d.inject_metadata({"orig": 1}) for d in ds]}
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
