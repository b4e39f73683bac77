"""Calls of upstream's log_rollout_data / log_eval_rollout_data (slime/observability/rollout_metrics.py), run on
upstream's module by record_upstream_rollout_logging_cases.py and on this project's by
tests/test_upstream_rollout_logging.py: each case gives what reached the trackers (record and step key), the
return value, and the custom log functions' calls."""

from __future__ import annotations

from types import SimpleNamespace

CALLS: list = []


def custom_rollout_log_true(rollout_id, args, samples, metrics, rollout_time):
    CALLS.append(["rollout", rollout_id, len(samples), sorted(metrics or {}), rollout_time])
    return True


def custom_rollout_log_false(rollout_id, args, samples, metrics, rollout_time):
    CALLS.append(["rollout", rollout_id, len(samples)])
    return False


def custom_eval_log_true(rollout_id, args, data, extra_metrics):
    CALLS.append(["eval", rollout_id, sorted(data), extra_metrics])
    return True


def custom_eval_log_none(rollout_id, args, data, extra_metrics):
    CALLS.append(["eval", rollout_id, sorted(data)])


BASE = {"advantage_estimator": "grpo", "reward_key": None, "log_reward_category": None, "rollout_num_gpus": 2,
        "custom_rollout_log_function_path": None, "custom_eval_rollout_log_function_path": None,
        "load_debug_rollout_data": None, "wandb_always_use_train_step": False, "rollout_batch_size": 2,
        "n_samples_per_prompt": 2, "global_batch_size": 2, "log_passrate": False, "n_samples_per_eval_prompt": 2,
        "use_wandb": False, "use_tensorboard": False}
HERE = "rollout_logging_cases."


def spec(i, group, reward, n_resp, **kw):
    return {"group_index": group, "index": i, "reward": reward, "response_length": n_resp, "response": f"r{i}",
            "status": kw.pop("status", "completed"), "non_generation_time": kw.pop("ngt", 0.0), **kw}


SAMPLES = [spec(0, 0, 1.0, 3), spec(1, 0, 0.0, 5, status="truncated", ngt=0.5), spec(2, 1, 1.0, 2, loss_mask=[1, 0]),
           spec(3, 1, 1.0, 4)]
ROLLOUT_CASES = [
    ({}, 3, {"rollout/custom": 1.5}, 2.0),
    ({"wandb_always_use_train_step": True, "global_batch_size": 3}, 5, None, 4.0),
    ({"custom_rollout_log_function_path": HERE + "custom_rollout_log_true"}, 1, {"a": 1}, 1.0),
    ({"custom_rollout_log_function_path": HERE + "custom_rollout_log_false"}, 2, {}, 1.0),
    ({"load_debug_rollout_data": "/tmp/rollout_{rollout_id}.pt"}, 0, {}, 1.0),
]
EVAL_CASES = [
    ({}, 4, {"math": {"rewards": [1.0, 0.0, 1.0, 1.0], "truncated": [False, True, False, False]}}, {"eval/x": 2.0}),
    ({"log_passrate": True}, 6, {"math": {"rewards": [1, 0, 1, 1], "samples": True},
                                 "code": {"rewards": [0.5, 0.5], "truncated": [0, 0]}}, None),
    ({"log_passrate": True, "n_samples_per_eval_prompt": 1}, 2, {"a": {"rewards": [1.0]}}, {}),
    ({"custom_eval_rollout_log_function_path": HERE + "custom_eval_log_true"}, 1, {"a": {"rewards": [1.0]}}, {"k": 1}),
    ({"custom_eval_rollout_log_function_path": HERE + "custom_eval_log_none", "wandb_always_use_train_step": True,
      "global_batch_size": 4}, 8, {"a": {"rewards": [0.0, 1.0]}}, None),
]


def run_all(rm, build, captured: list) -> list:
    """`rm`: the module under test; `build(spec)`: its Sample from a spec; `captured`: filled with
    [record, step_key] by the module's tracker sink (patched by the caller)."""
    out = []
    for overrides, rollout_id, extra, rollout_time in ROLLOUT_CASES:
        CALLS.clear(), captured.clear()
        args = SimpleNamespace(**{**BASE, **overrides})
        ret = rm.log_rollout_data(rollout_id, args, [build(s) for s in SAMPLES], extra, rollout_time)
        out.append({"fn": "log_rollout_data", "ret": ret, "sent": list(captured), "calls": list(CALLS)})
    for overrides, rollout_id, data, extra in EVAL_CASES:
        CALLS.clear(), captured.clear()
        args = SimpleNamespace(**{**BASE, **overrides})
        data = {k: {**v, "samples": [build(s) for s in SAMPLES]} if v.get("samples") else v for k, v in data.items()}
        ret = rm.log_eval_rollout_data(rollout_id, args, data, extra)
        out.append({"fn": "log_eval_rollout_data", "ret": ret, "sent": list(captured), "calls": list(CALLS),
                    "extra_is_record": extra is not None and ret is extra})
    return out
