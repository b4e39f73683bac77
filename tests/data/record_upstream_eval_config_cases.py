"""Records tests/data/upstream_eval_config_cases.json: upstream slime's slime/utils/eval_config.py (which imports
nothing of slime) run outside this repository on the inputs below: list normalization, flag fallback, an entry's
explicit None, defaults for keys with no flag, and what it refuses (exception type):
    git -C UPSTREAM show COMMIT:slime/utils/eval_config.py > /tmp/up/upstream_eval_config.py
    python tests/data/record_upstream_eval_config_cases.py /tmp/up/upstream_eval_config.py COMMIT OUT.json
tests/test_upstream_eval_config_module.py compares slime.utils.eval_config with these outputs.
"""
import dataclasses
import json
import sys
import types
from types import SimpleNamespace

up = sys.modules["up"] = types.ModuleType("up")  # dataclasses look their module up
exec(open(sys.argv[1]).read(), up.__dict__)


def run(fn):
    try:
        return {"ok": fn()}
    except (ValueError, TypeError) as e:
        return {"error": type(e).__name__}


cases = []
for cfg in (None, {}, [], {"a": {"path": "a.jsonl"}, "b": None, "c": {"name": "c2", "path": "c"}},
            [{"name": "x", "path": "x"}, {"name": "y"}], [{"path": "x"}], [None], "aime", 3, ({"name": "t"},)):
    cases.append({"fn": "ensure_dataset_list", "input": cfg, "tuple": isinstance(cfg, tuple),
                  "out": run(lambda cfg=cfg: up.ensure_dataset_list(cfg))})
ARGS = [{"a": None, "b": 0, "c": 5}, {"a": 1}, {}, {"a": None}]
for a in ARGS:
    for attrs in (("a", "b", "c"), ("b", "a"), ("c",), (), ("zz", "a")):
        cases.append({"fn": "pick_from_args", "args": a, "attrs": list(attrs),
                      "out": up.pick_from_args(SimpleNamespace(**a), attrs)})
FLAGS = {"n_samples_per_prompt": 4, "rollout_temperature": 0.7, "eval_top_p": 0.9, "rollout_top_k": 10,
         "rollout_max_response_len": 32, "eval_min_new_tokens": None, "input_key": "q", "eval_label_key": None,
         "label_key": "lab", "custom_rm_path": "m.rm", "eval_custom_rm_path": "m.eval_rm", "apply_chat_template": False,
         "multimodal_keys": {"image": "img"}}
BUILDS = [
    ([{"name": "a", "path": "a"}], {}),
    ([{"name": "a", "path": "a", "temperature": None, "top_k": 3}], {"temperature": 0.2, "top_k": 4}),
    ([{"name": "a", "path": "a"}, {"name": "b", "path": "b", "rm_type": "x"}],
     {"rm_type": "math", "repetition_penalty": 1.2, "app_service": "http://h:1", "min_eval_samples": 2,
      "metadata_overrides": {"k": 1}}),
    ([{"name": "a", "path": "a", "metadata_overrides": None, "max_response_len": 8}], None),
    ([{"name": "a", "path": "a"}], {"bogus": 1}),
    ([{"name": "a", "path": "a", "bogus": 1}], {}),
    ([{"name": "a", "path": "a", "min_eval_samples": 0}], {}),
    ([{"name": "a", "path": "a"}], {"min_eval_samples": -1}),
    ([{"name": "a", "path": "a", "metadata_overrides": [1]}], {}),
    ([{"name": "a"}], {}),
    ([], {"temperature": 1.0}),
]
for entries, defaults in BUILDS:
    def build(entries=entries, defaults=defaults):
        built = up.build_eval_dataset_configs(SimpleNamespace(**FLAGS), entries, defaults)
        return [{"fields": dataclasses.asdict(d), "cache_key": list(d.cache_key),
                 "metadata": [d.inject_metadata({"orig": 1, "rm_type": "old"}), d.inject_metadata("not a dict")]}
                for d in built]
    cases.append({"fn": "build_eval_dataset_configs", "entries": entries, "defaults": defaults, "out": run(build)})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/utils/eval_config.py",
           "recorded_with": "upstream's file run on these inputs, outside this repository", "flags": FLAGS,
           "fields": [f.name for f in dataclasses.fields(up.EvalDatasetConfig)], "cases": cases},
          open(sys.argv[3], "w"), indent=0)
print(len(cases))
