"""Records tests/data/upstream_rollout_metrics_cases.json: upstream slime's slime/observability/rollout_metrics.py
compute_metrics_from_samples / compute_perf_metrics_from_samples, run outside this repository with upstream's own
metric_utils.py and utils/types.py (Sample) from the same commit; the rest it imports (logging, misc) are stand-ins
it does not reach for these two functions, except group_by (upstream's one-line semantics):
    mkdir /tmp/up; for f in observability/rollout_metrics.py observability/metric_utils.py utils/types.py; do
      git -C UPSTREAM show COMMIT:slime/$f > /tmp/up/$(basename $f); done
    python tests/data/record_upstream_rollout_metrics_cases.py /tmp/up COMMIT OUT.json
Samples are described as data (SAMPLES below); the test builds this project's Samples from the same data.
"""
import json
import random
import sys
import types
from collections import defaultdict
from types import SimpleNamespace


def module(name, **attrs):
    m = sys.modules[name] = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def group_by(iterable, key=None):
    out = defaultdict(list)
    for item in iterable:
        out[key(item) if key is not None else item].append(item)
    return dict(out)


root = sys.argv[1]
for name in ("slime", "slime.utils", "slime.observability"):
    module(name)
module("slime.utils.misc", group_by=group_by, load_function=None, decode_int32_meta_array=None)
module("slime.observability.logging_utils", log=None)
for name, file in (("slime.utils.types", "types.py"), ("slime.observability.metric_utils", "metric_utils.py"),
                   ("up", "rollout_metrics.py")):
    m = module(name)
    exec(open(f"{root}/{file}").read(), m.__dict__)
up = sys.modules["up"]
Sample = sys.modules["slime.utils.types"].Sample

rnd = random.Random(11)


def spec(i, group, reward, n_resp, **kw):
    d = {"group_index": group, "reward": reward, "response_length": n_resp, "response": kw.pop("response", f"r{i}"),
         "status": kw.pop("status", "completed"), "non_generation_time": kw.pop("ngt", 0.0)}
    d.update(kw)
    return d


SETS = []
SETS.append([spec(i, i // 2, [1.0, 1.0, 0.0, 1.0, 0.5, 0.5][i], 3 + i) for i in range(6)])
SETS.append([spec(0, 0, 1.0, 4, loss_mask=[1, 0, 1, 1], status="truncated", ngt=0.5,
                  rollout_top_p_token_offsets=[0, 3, 5, 9, 10], spec_info={"spec_accept_token_num": 6,
                  "spec_draft_token_num": 8, "spec_verify_ct": 3, "completion_token_num": 9},
                  prefix_cache_info={"cached_tokens": 5, "total_prompt_tokens": 8}),
             spec(1, 0, 1.0, 2, loss_mask=[1, 1], ngt=1.25, rollout_top_p_token_offsets=[0, 1, 4],
                  prefix_cache_info={"cached_tokens": 0, "total_prompt_tokens": 8}),
             spec(2, 1, 0.0, 4, response="ab" * 6000, remove_sample=True, rollout_top_p_token_offsets=[0, 1, 2, 3, 4],
                  trace={"events": [{"type": "span_end", "name": "sglang_generate",
                                     "attrs": {"e2e_latency": 1.5, "queue_time": 0.25, "decode_throughput": True,
                                               "pd_transfer_total_mb": float("nan")}},
                                    {"type": "span_end", "name": "other", "attrs": {"e2e_latency": 9.0}},
                                    {"type": "span_end", "name": "sglang_generate",
                                     "attrs": {"e2e_latency": 2.5, "pd_decode_forward_duration": 0.125}}]}),
             spec(3, 1, 0.0, 0, loss_mask=[], rollout_top_p_token_offsets=[0])])
SETS.append([spec(i, i // 4, {"acc": rnd.choice([0, 1]), "cat": rnd.choice(["ok", "format", "wrong"])},
                  rnd.randrange(1, 9), ngt=rnd.choice([0.0, 0.3, 2.0])) for i in range(12)])
ARGS = [
    {"advantage_estimator": "grpo", "reward_key": None, "log_reward_category": None, "rollout_num_gpus": 2},
    {"advantage_estimator": "ppo", "reward_key": None, "log_reward_category": None, "rollout_num_gpus": 0,
     "sglang_speculative_algorithm": "EAGLE"},
    {"advantage_estimator": "grpo", "reward_key": "acc", "log_reward_category": "cat", "rollout_num_gpus": 4},
]


def build(d):
    d = dict(d)
    s = Sample(status=Sample.Status(d.pop("status")))
    si, pc = d.pop("spec_info", None), d.pop("prefix_cache_info", None)
    if si:
        s.spec_info = Sample.SpecInfo(**si)
    if pc:
        s.prefix_cache_info = Sample.PrefixCacheInfo(**pc)
    for k, v in d.items():
        setattr(s, k, v)
    return s


def run(fn):
    try:
        return {"ok": fn()}
    except (AssertionError, ValueError, ZeroDivisionError) as e:
        return {"error": type(e).__name__}


cases = []
for samples, args in zip(SETS, ARGS):
    ns = SimpleNamespace(**args)
    cases.append({"fn": "compute_metrics_from_samples", "args": args, "samples": samples,
                  "out": run(lambda ns=ns, samples=samples: up.compute_metrics_from_samples(ns, [build(s) for s in samples]))})
    cases.append({"fn": "compute_perf_metrics_from_samples", "args": args, "samples": samples, "rollout_time": 7.5,
                  "out": run(lambda ns=ns, samples=samples: up.compute_perf_metrics_from_samples(
                      ns, [build(s) for s in samples], 7.5))})
bad = [spec(0, 0, 1.0, 3, rollout_top_p_token_offsets=[0, 1, 2])]
cases.append({"fn": "compute_metrics_from_samples", "args": ARGS[0], "samples": bad,
              "out": run(lambda: up.compute_metrics_from_samples(SimpleNamespace(**ARGS[0]), [build(s) for s in bad]))})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/observability/rollout_metrics.py",
           "recorded_with": "upstream's rollout_metrics.py, metric_utils.py and utils/types.py run on these inputs, "
           "outside this repository", "cases": cases}, open(sys.argv[3], "w"), indent=0, allow_nan=True)
print(len(cases))
